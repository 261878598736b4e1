"""Serving bfloat16 end to end: a float32 trainer refits a bfloat16 vLLM generator (real processes).

The trainer keeps float32 weights and exports each step in bfloat16; the refit rounds the same
float32 values to bfloat16 on the sender (to nearest even, as the export does), so after a refit
the generator must generate exactly as when it loads that bfloat16 export through vLLM's own
loaders, and the wire must carry half the bytes of the float32 weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors import safe_open


pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


def _elements(checkpoint: Path) -> int:
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


@pytest.mark.parametrize("layout, tp, steps", [((1, 2, 2), 1, 1), ((2, 2, 1), 2, 2)],
                         ids=["pp1-ep2-tp2-into-tp1", "pp2-ep2-tp1-into-tp2-two-steps"])
def test_a_float32_trainer_refits_a_bfloat16_generator_exactly_as_its_bfloat16_export(stack, model, tmp_path,
                                                                                       layout, tp, steps):
    pp, ep, ttp = layout
    stack.start_syncd(trainers=pp * ep * ttp, db=f"{tmp_path.name}.db")
    generator = stack.start_generator(model, tp=tp, dtype="bfloat16", name=f"generator-bf16-tp{tp}")
    try:
        trainer = stack.train(model, pp=pp, ep=ep, tp=ttp, steps=steps, export=tmp_path / "export",
                              export_dtype="bfloat16")
        states = []
        for step in range(1, steps + 1):
            stack.wait_announced(step)
            states.append(stack.refit(step))
        assert trainer.popen.wait(180) == 0, trainer.tail()
        assert [s["state"] for s in states] == ["COMMITTED"] * steps, states
        export = tmp_path / "export" / f"step-{steps}"
        if tp == 1:  # one receiver holding every element once: bfloat16 on the wire, 2 bytes each
            assert all(s["bytes"] == 2 * _elements(export) for s in states), states
        after_refit = generator.greedy()
        generator.load(export, version=5000 + steps)
        assert after_refit == generator.greedy()
    finally:
        generator.proc.stop()
