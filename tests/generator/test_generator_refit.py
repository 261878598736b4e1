"""Refits of a running generator through the worker extension's receive path (real vLLM, CPU).

The shared service starts on checkpoint A. Every test leaves it serving A again.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from syncd.weight_version import version_of_label
from tests.generator.conftest import PROMPTS, Service

pytestmark = pytest.mark.vllm


def load(service: Service, path: Path, version: str) -> dict:
    r = service.http.post("/v1/weights/load", json={"path": str(path), "version": version})
    return {"status": r.status_code, **r.json()}


def variant(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` with its tensors edited."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_pushing_b_into_an_engine_on_a_matches_a_fresh_engine_on_b(
    service_a: Service, outputs_a: dict, outputs_fresh_b: dict, checkpoints: dict
) -> None:
    """A's engine forked (generator_svc's default), B's was spawned (vLLM's): equal outputs here
    also say the two ways of starting compute the same."""
    assert outputs_a != outputs_fresh_b, "A and B must generate differently for this test to mean anything"
    assert load(service_a, checkpoints["B"], "1") == {"status": 200, "version": "1", "serving": True}
    try:
        assert service_a.http.get("/v1/weight_version").json()["version"] == "1"
        for name in PROMPTS:  # greedy tokens and logprobs equal, bit for bit (float32)
            assert service_a.complete(PROMPTS[name]) == outputs_fresh_b[name], name
    finally:
        assert load(service_a, checkpoints["A"], "2")["status"] == 200
    assert service_a.outputs() == outputs_a


def test_a_forked_worker_is_bound_to_the_core_a_spawned_one_gets(service_a: Service) -> None:
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if not bind.isdigit():
        pytest.skip("the engines are bound to one core only on pytest-xdist's workers (tests/conftest.py)")
    processes = psutil.Process(service_a.proc.pid).children(recursive=True)
    workers = [p for p in processes if p.name().startswith("VLLM::Worker")]
    assert [w.cpu_affinity() for w in workers] == [[int(bind)]]


def test_forked_engine_processes_leave_the_listening_socket_to_the_api_server(service_a: Service) -> None:
    """A forked child closes its copy of the API server's socket (generator_svc.server.engine_start):
    only the API server listens on the port."""
    server = psutil.Process(service_a.proc.pid)
    listening = {
        p.pid
        for p in [server, *server.children(recursive=True)]
        for c in p.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == service_a.port
    }
    assert listening == {server.pid}


def test_requests_during_a_refit_are_held_not_failed(
    service_a: Service, outputs_a: dict, checkpoints: dict
) -> None:
    statuses: list[int] = []

    def generate() -> None:
        for _ in range(6):
            r = service_a.http.post(
                "/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": PROMPTS["long"],
                    "max_tokens": 16,
                    "temperature": 0,
                    "detokenize": False,
                    "return_tokens_as_token_ids": True,
                },
            )
            statuses.append(r.status_code)

    clients = [threading.Thread(target=generate) for _ in range(2)]
    for c in clients:
        c.start()
    try:
        for version, ckpt in (("3", "B"), ("4", "A"), ("5", "B")):
            assert load(service_a, checkpoints[ckpt], version)["status"] == 200
    finally:
        for c in clients:
            c.join()
        assert load(service_a, checkpoints["A"], "6")["status"] == 200
    assert statuses == [200] * 12
    assert service_a.outputs() == outputs_a


def test_failed_refits_leave_a_serving_and_a_good_refit_still_works(
    service_a: Service, outputs_a: dict, outputs_fresh_b: dict, checkpoints: dict, tmp_path: Path
) -> None:
    version = service_a.http.get("/v1/weight_version").json()["version"]
    q = "model.layers.1.self_attn.q_proj.weight"
    bad_shape = variant(
        checkpoints["B"], tmp_path / "bad_shape", lambda t: t.update({q: torch.zeros(64, 128)})
    )
    missing = variant(
        checkpoints["B"], tmp_path / "missing", lambda t: t.pop("model.layers.2.self_attn.k_proj.weight")
    )
    half = variant(
        checkpoints["B"],
        tmp_path / "half",  # a transfer cut off after layer 1
        lambda t: [t.pop(n) for n in list(t) if n.startswith(("model.layers.2.", "model.layers.3."))],
    )

    r = load(service_a, bad_shape, "bad")
    assert (
        r["status"] == 409
        and f"{q}: checkpoint shape (64, 128) != catalog shape (128, 128)" in r["error"]["message"]
    )
    r = load(service_a, missing, "missing")
    assert r["status"] == 409
    assert (
        "not completely staged: generator-0-0: model.layers.2.self_attn.qkv_proj.weight (24576/32768"
        in r["error"]["message"]
    )
    # Interrupted transfer: B fully staged, then a new refit starts and stops half way; the
    # half-received version is refused and B's earlier bytes do not count for it.
    assert (
        service_a.http.post(
            "/v1/weights/stage", json={"path": str(checkpoints["B"]), "refit_id": "r1"}
        ).status_code
        == 200
    )
    assert (
        service_a.http.post("/v1/weights/stage", json={"path": str(half), "refit_id": "r2"}).status_code
        == 200
    )
    r = service_a.http.post("/v1/weights/apply", json={"version": "half"})
    assert r.status_code == 409 and "model.layers.2." in r.json()["error"]["message"]
    # Aborted refit: nothing staged any more.
    assert service_a.http.post("/v1/weights/abort", json={}).status_code == 200
    r = service_a.http.post("/v1/weights/apply", json={"version": "aborted"})
    assert r.status_code == 409 and "nothing staged" in r.json()["error"]["message"]
    # One error body: ours is the one vLLM's own endpoints answer on the same port.
    vllm_error = service_a.http.post("/v1/completions", json={"model": "no-such-model", "prompt": [1]}).json()
    assert set(r.json()["error"]) >= {"message", "type", "code"} and r.json()["error"]["code"] == 409
    assert set(vllm_error["error"]) >= {"message", "type", "code"}, vllm_error

    assert service_a.http.get("/healthz").status_code == 200
    assert service_a.http.get("/v1/weight_version").json() == {
        "version": version,
        "step": version_of_label(version),
        "serving": True,
        "updating": False,
    }
    assert service_a.outputs() == outputs_a, "failed refits must not change what the engine serves"
    metrics = service_a.http.get("/metrics").text
    assert 'weightsync_generator_refits_total{outcome="refused"}' in metrics

    assert load(service_a, checkpoints["B"], "7")["status"] == 200
    try:
        assert service_a.outputs() == outputs_fresh_b
    finally:
        assert load(service_a, checkpoints["A"], "8")["status"] == 200
    assert service_a.outputs() == outputs_a
