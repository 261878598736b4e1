"""Adapter slots on a dense Qwen3 (vLLM on CPU serves LoRA on dense models only): two adapters
written alternately into their slots over three steps, each time equal, token for token and
logprob for logprob, to a fresh engine loading that step's adapter from a PEFT-format directory,
and the other adapter's slot bytes unchanged by each write."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from deploy.local.processes import PYTHON, REPO
from testkit.tiny_dense import make_tiny_dense

PROBE = Path(__file__).with_name("lora_slots_probe.py")


def _probe(model: Path, work: Path, role: str) -> dict:
    env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    run = subprocess.run(
        [PYTHON, str(PROBE), "--model", str(model), "--work", str(work), "--role", role],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads((work / f"{role}.json").read_text())


def test_two_adapters_written_alternately_into_slots_equal_peft_loads_and_leave_each_other_alone(tmp_path):
    model = make_tiny_dense(tmp_path / "dense")
    slots = _probe(model, tmp_path, "slots")
    reference = _probe(model, tmp_path, "reference")  # a fresh engine, after the slots' is gone
    assert [s["added"] for s in slots["steps"]] == [True, True, False]  # step 3 rewrites a's slot
    for s in slots["steps"]:
        for name, step in s["served"].items():
            assert s["outputs"][name] == reference[f"{name}-{step}"], (s["adapter"], s["step"], name)
        others = {n: d for n, d in s["digests_before"].items() if n != s["adapter"]}
        assert {n: s["digests_after"][n] for n in others} == others, s
        if s["adapter"] in s["digests_before"]:
            assert s["digests_after"][s["adapter"]] != s["digests_before"][s["adapter"]], s
    assert slots["steps"][-1]["outputs"]["a"] != slots["base"]  # the adapters change what it generates
