"""Adapter slots through syncd on a dense Qwen3 (vLLM on CPU serves LoRA on dense models only):
a real syncd, a real generator_svc started with LoRA, and two named adapters' trainers
(`syncd.member.adapter_sender`) refitted alternately over three steps. After each refit the
generator answers `model: "<adapter>"` with the adapter's new version, token for token and
logprob for logprob as a fresh vLLM loading that step's adapter from a PEFT-format directory;
the other adapter's slot digest and the base model's outputs are unchanged by it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from syncd.member.adapter_sender import attach_adapter
from syncd.net import free_port
from syncd.refit_wait import wait_final
from testkit.tiny_dense import TARGETS, adapter_shapes, make_tiny_dense, random_adapter, write_peft_adapter
from tests.control.syncd_harness import SyncdProcess
from tests.generator.conftest import PROMPTS, Service
from tests.polling import wait_until

pytestmark = pytest.mark.vllm

RANK, ALPHA = 8, 16.0
STEPS = (("a", 1), ("b", 2), ("a", 3))  # (adapter, step): alternately; the step seeds its factors
LORA_ARGS = ("--dtype", "bfloat16", "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2")


def complete(service: Service, model: str, prompt: list[int]) -> tuple[list, str | None]:
    """Greedy tokens and logprobs of `model` (the base or an adapter), and the adapter version
    the response says it used."""
    r = service.http.post(
        "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1,
              "detokenize": False, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    version = choice.get("adapter", {}).get("version")
    if version is not None:
        assert r.headers["x-adapter-version"] == f"{model}:{version}"
    return [lp["tokens"], lp["token_logprobs"]], version


def outputs(service: Service, model: str) -> tuple[list, set]:
    answers = [complete(service, model, p) for p in PROMPTS.values()]
    return [o for o, _ in answers], {v for _, v in answers}


def refit(http: httpx.Client, name: str) -> dict:
    """Trigger a refit of adapter `name` once syncd has its trainer's announcement; its record."""
    answers: list[httpx.Response] = []

    def started() -> bool:
        answers.append(http.post("/v1/refits", json={"adapter": name}))
        assert answers[-1].status_code in (202, 409), answers[-1].text
        return answers[-1].status_code == 202

    wait_until(started, what=f"a refit of adapter {name} to start ({answers[-1:]})")
    return dict(wait_final(lambda path: http.get(path).json(), answers[-1].json()["id"], 120))


def slot_digests(service: Service) -> dict[str, str]:
    return {a["name"]: a["digest"] for a in service.http.get("/v1/adapters").json()["adapters"]}


def test_two_adapters_refitted_through_syncd_equal_peft_loads_and_leave_each_other_alone(tmp_path: Path):
    model = make_tiny_dense(tmp_path / "dense")
    peft = {f"{n}-{s}": write_peft_adapter(tmp_path / f"peft-{n}-{s}", random_adapter(RANK, s), RANK, ALPHA)
            for n, s in STEPS}  # fmt: skip
    syncd = SyncdProcess(tmp_path / "syncd.db", free_port(), free_port()).start()
    generator = Service(model, tmp_path / "generator.log", *LORA_ARGS, "--syncd", syncd.target)
    modules = [f"{name}={path}" for name, path in peft.items()]
    reference = Service(model, tmp_path / "reference.log", *LORA_ARGS, "--max-cpu-loras", "4",
                        "--lora-modules", *modules)  # fmt: skip
    http = httpx.Client(base_url=syncd.url, timeout=30)
    senders = {}
    try:
        expected = {name: outputs(reference.wait_ready(), name)[0] for name in peft}
        reference.stop()
        generator.wait_ready()
        base = outputs(generator, "tiny")[0]
        for name in ("a", "b"):
            factors = random_adapter(RANK, seed=0)
            senders[name] = attach_adapter(syncd.target, name, factors, alpha=ALPHA, target_modules=TARGETS)
            assert senders[name].membership.client.wait_registered()
        versions = {"a": 0, "b": 0}
        served: dict[str, int] = {}
        for name, step in STEPS:
            sender = senders[name]
            with sender.lock:
                for n, t in random_adapter(RANK, seed=step).items():
                    sender.factors[n].copy_(t)
            versions[name] += 1
            sender.publish(versions[name])
            before = slot_digests(generator)
            record = refit(http, name)
            assert record["state"] == "COMMITTED", record["error"]
            assert (record["adapter"], record["weight_version"]) == (name, versions[name])
            # Only the adapter moved: its factors in the slots' bfloat16, nothing of the base.
            assert record["bytes"] == sum(r * c * 2 for r, c in adapter_shapes(RANK).values())
            served[name] = step
            after = slot_digests(generator)
            for other in served.keys() - {name}:
                assert after[other] == before[other], f"refit of {name} changed {other}'s slot"
            if name in before:
                assert after[name] != before[name]
            for n, s in served.items():
                got, said = outputs(generator, n)
                assert got == expected[f"{n}-{s}"], (name, step, n)
                assert said == {str(versions[n])}
            assert outputs(generator, "tiny")[0] == base  # the base is never touched
        assert expected["a-3"] != base  # the adapters change what it generates
        adapters = {a["name"]: a for a in http.get("/v1/adapters").json()["adapters"]}
        assert (adapters["a"]["committed_version"], adapters["b"]["committed_version"]) == (2, 1)
    finally:
        for sender in senders.values():
            sender.close()
        generator.stop()
        reference.stop()
        http.close()
        syncd.stop()
