"""End to end: a transformers Qwen3-MoE trained with FSDP2, TP and FSDP2 + TP (2 x 2) on 4 gloo
ranks, attached with `syncd.member.attach.attach` (the example's rank job, one call), refits a TP 1
and a TP 2 vLLM CPU generator at once.

After each refit both generators must generate exactly (greedy tokens and logprobs) as an engine
holding the gathered state dict (`DTensor.full_tensor()`, saved by transformers in the served
bfloat16, which the generator's load route requires): the generator
itself after loading it through vLLM's own loaders (tests/generator shows that such a load
generates exactly as a fresh engine), so two engines serve the whole module. The example's own
check against a truly fresh engine runs in `test_example_against_a_fresh_engine`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.local.processes import PYTHON, REPO

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

EXAMPLE = REPO / "examples" / "fsdp2_tp_refit.py"
TRAINERS, GENERATOR_WORKERS = 4, 3  # a TP 1 and a TP 2 generator


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE with 4 kv heads, so attention splits over tp 4 in whole heads."""
    from trainer_svc.config import ModelArgs
    from trainer_svc.tiny import TINY_ARGS, make_tiny_checkpoint

    args = ModelArgs(**{**TINY_ARGS.__dict__, "num_key_value_heads": 4})
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kv4"), seed=0, args=args)


@pytest.fixture(scope="module")
def generators(stack, model):
    stack.start_syncd(trainers=TRAINERS, generators=GENERATOR_WORKERS)
    tp1 = stack.start_generator(model, tp=1)
    tp2 = stack.start_generator(model, tp=2, name="generator-tp2", replica=1)
    return {"tp1": tp1, "tp2": tp2}


@pytest.mark.parametrize("layout", ["fsdp2", "tp", "fsdp2tp"])
def test_dtensor_trainer_refits_tp1_and_tp2_generators_exactly(stack, generators, model, layout, tmp_path):
    stack.start_syncd(trainers=TRAINERS, generators=GENERATOR_WORKERS, db=f"{layout}.db")
    gathered = tmp_path / "gathered"
    before = {name: g.greedy() for name, g in generators.items()}
    job = stack.cluster.start(
        f"trainer-{layout}",
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(TRAINERS),
         str(EXAMPLE), "--rank-job", "--layout", layout, "--model", str(model), "--syncd", stack.target,
         "--steps", "1", "--lr", "1e-3", "--gathered", str(gathered), "--gathered-dtype", "bfloat16"],
        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    stack.wait_announced(1)
    state = stack.refit(1)
    assert state["state"] == "COMMITTED", state
    assert job.popen.wait(300) == 0, job.tail(60)
    for i, (name, generator) in enumerate(generators.items()):
        after_refit = generator.greedy()
        assert after_refit != before[name]  # the step moved the weights, and the refit moved them
        generator.load(gathered, version=7000 + 10 * len(layout) + i)
        assert after_refit == generator.greedy(), f"{name} after the refit != the gathered state dict"


def test_example_against_a_fresh_engine(tmp_path):
    """The example as a user runs it: FSDP2 + TP, 2 steps, its default TP 1 generator and a fresh
    engine on the gathered state dict. The tests above refit a TP 2 generator from every layout
    exactly; a fresh TP 2 engine beside them would only cost a fresh engine's start."""
    summary_file = tmp_path / "summary.json"
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--layout", "fsdp2tp", "--steps", "2",
         "--workdir", str(tmp_path / "work"), "--summary-json", str(summary_file)],
        cwd=REPO, env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    summary = json.loads(summary_file.read_text())
    assert summary["refits"] == summary["refits_committed"] == 2, summary
    assert summary["tokens_equal"] and summary["max_abs_logprob_diff"] == 0.0, summary
