"""A bfloat16 generator (real vLLM on CPU) takes a float32 checkpoint through /v1/weights/load as
vLLM's startup does, refuses what no conversion covers, answers overload with 429 and
`Retry-After`, and when its engine dies says so (503s, metric, log) and exits to be restarted.

One generator, small admission bounds, in the order: load, overload, death (the last ends it)."""

from __future__ import annotations

import concurrent.futures
import re
import signal
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.generator.conftest import PROMPTS, Service
from tests.polling import wait_until

pytestmark = pytest.mark.vllm
EXIT_AFTER_S = 15


@pytest.fixture(scope="module")
def bf16(checkpoints, tmp_path_factory):
    """A bfloat16 generator on A (1 running + 1 queued request at most) and a fresh bfloat16
    engine on B, started together; the fresh one only records B's reference outputs."""
    logs = tmp_path_factory.mktemp("bf16-logs")
    served = Service(
        checkpoints["A"],
        logs / "served.log",
        "--dtype",
        "bfloat16",
        "--max-concurrent-requests",
        "1",
        "--max-queued-requests",
        "1",
        "--engine-death-exit-s",
        str(EXIT_AFTER_S),
    )
    fresh = Service(checkpoints["B"], logs / "fresh.log", "--dtype", "bfloat16")
    try:
        reference_b = fresh.wait_ready().outputs()
        fresh.stop()
        yield served.wait_ready(), reference_b
    finally:
        fresh.stop()
        served.stop()


def test_a_float32_checkpoint_loads_into_a_bfloat16_generator_as_at_startup(bf16, checkpoints):
    served, reference_b = bf16
    assert {str(v.dtype) for v in load_file(checkpoints["B"] / "model.safetensors").values()} == {
        "torch.float32"
    }
    r = served.http.post("/v1/weights/load", json={"path": str(checkpoints["B"]), "version": "b"})
    assert r.status_code == 200, r.text
    # Same float32 weights rounded to nearest even at load as at startup: same tokens, same logprobs.
    assert served.outputs() == reference_b


def test_a_checkpoint_no_conversion_covers_is_refused_naming_the_pair(bf16, checkpoints, tmp_path: Path):
    served, reference_b = bf16
    tensors = {k: v.to(torch.float64) for k, v in load_file(checkpoints["A"] / "model.safetensors").items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    r = served.http.post("/v1/weights/load", json={"path": str(tmp_path), "version": "f64"})
    assert r.status_code == 409, r.text
    assert re.search(r"cannot convert float64 \(source\) to bfloat16", r.json()["error"]["message"]), r.text
    assert served.outputs() == reference_b  # the served weights did not change


def test_overload_is_answered_429_with_retry_after_and_nothing_breaks(bf16):
    served, reference_b = bf16
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 250, "ignore_eos": True, "temperature": 0}

    # The service's client, made before any request leaves: a client per request builds an SSL
    # context each, and while the engine runs the first request those took up to 3 s of this
    # process's CPU here, so the requests left one by one and never overlapped.
    def post(_: int) -> httpx.Response:
        return served.http.post("/v1/completions", json=body)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(8)))
    statuses = sorted(r.status_code for r in answers)
    assert set(statuses) == {200, 429}, statuses  # one runs, one waits, the rest are refused at once
    for r in answers:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1", dict(r.headers)
            assert "--max-concurrent-requests 1" in r.json()["error"]["message"], r.text
        else:
            assert r.json()["usage"]["completion_tokens"] == 250, r.text
    assert served.http.get("/healthz").status_code == 200
    assert served.outputs() == reference_b


def _metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def test_when_the_engine_dies_the_generator_says_so_then_exits_for_a_restart(bf16):
    served, _ = bf16
    cores = [p for p in psutil.Process(served.proc.pid).children(recursive=True) if "EngineCore" in p.name()]
    assert len(cores) == 1, [p.name() for p in psutil.Process(served.proc.pid).children(recursive=True)]
    cores[0].send_signal(signal.SIGKILL)

    health = wait_until(
        lambda: (r := served.http.get("/healthz")).status_code == 503 and r, 60, "/healthz 503"
    )
    assert health.json()["status"] == "engine dead", health.text
    r = served.http.post(
        "/v1/completions", json={"model": "tiny", "prompt": PROMPTS["short"], "max_tokens": 4}
    )
    assert r.status_code == 503 and "engine of this generator has died" in r.json()["error"]["message"], (
        r.text
    )
    assert r.headers["retry-after"] == "1"
    metrics = wait_until(
        lambda: (
            _metric(text := served.http.get("/metrics").text, "weightsync_generator_engine_alive") == 0
            and text
        ),
        30,
        "engine_alive 0",
    )
    assert _metric(metrics, "weightsync_generator_engine_deaths_total") == 1
    assert served.proc.wait(EXIT_AFTER_S + 120) == 1
    log = served.log.read_text(errors="replace")
    assert re.search(r"the vLLM engine died: .*exited with -9 \(SIGKILL\)", log), served.log_tail()
