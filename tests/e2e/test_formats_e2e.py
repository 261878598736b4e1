"""Serving bfloat16 end to end, as users run it (real processes):
- a bfloat16 trainer (float32 masters) refits a bfloat16 vLLM generator after every step, and after
  each refit the generator generates exactly as a separate vLLM engine holding the trainer's
  bfloat16 export of that step: started fresh on step 1's, then given step 2's through vLLM's own
  loader; for the trainer layouts (1,2,2) and (2,2,1), each into a vLLM TP 1 and a TP 2 generator
  at once;
- a float32 trainer refits the same generator with the sender rounding to bfloat16 (to nearest
  even, as the export does): exactly its bfloat16 export, with 2 bytes per weight on the wire, half
  of float32.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors import safe_open

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


def _elements(checkpoint: Path) -> int:
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 - safe_open is not iterable


@pytest.mark.parametrize("layout", [(1, 2, 2), (2, 2, 1)], ids=["pp1-ep2-tp2", "pp2-ep2-tp1"])
def test_a_bfloat16_trainer_refit_generates_as_vllm_on_its_export_after_every_step(
    stack, model, tmp_path, layout
):
    """One trainer job refits a TP-1 and a TP-2 generator at once; each is then compared with its
    own reference engine (TP 2 sums in another order than TP 1)."""
    pp, ep, ttp = layout
    steps = 2
    stack.start_syncd(trainers=pp * ep * ttp, generators=1 + 2, db=f"{tmp_path.name}.db")
    generators = {
        tp: stack.start_generator(model, tp=tp, replica=tp - 1, name=f"generator-bf16-tp{tp}")
        for tp in (1, 2)
    }
    try:
        trainer = stack.train(model, pp=pp, ep=ep, tp=ttp, steps=steps, export=tmp_path / "export")
        served: dict[int, list] = {tp: [] for tp in generators}
        for step in range(1, steps + 1):
            stack.wait_announced(step)
            state = stack.refit(step)
            assert state["state"] == "COMMITTED", state
            for tp, generator in generators.items():
                served[tp].append(generator.greedy())
        assert trainer.popen.wait(180) == 0, trainer.tail()
    finally:
        for generator in generators.values():
            generator.proc.stop()
            stack.cluster.procs.remove(generator.proc)

    export = tmp_path / "export"
    for tp in generators:
        reference = stack.start_generator(
            export / "step-1", tp=tp, syncd=False, name=f"reference-bf16-tp{tp}"
        )
        try:
            assert served[tp][0] == reference.greedy(), f"step 1, TP {tp}"
            reference.load(export / "step-2", version=2)
            assert served[tp][1] == reference.greedy(), f"step 2, TP {tp}"
        finally:
            reference.proc.stop()
            stack.cluster.procs.remove(reference.proc)


def test_a_float32_trainer_refits_a_bfloat16_generator_with_half_the_bytes(stack, model, tmp_path):
    stack.start_syncd(trainers=4, db="float32-trainer.db")
    generator = stack.start_generator(model, name="generator-bf16-from-f32")
    try:
        trainer = stack.train(
            model,
            pp=1,
            ep=2,
            tp=2,
            steps=1,
            export=tmp_path / "export",
            dtype="float32",
            export_dtype="bfloat16",
        )
        stack.wait_announced(1)
        state = stack.refit(1)
        assert trainer.popen.wait(180) == 0, trainer.tail()
        assert state["state"] == "COMMITTED", state
        export = tmp_path / "export" / "step-1"
        # one TP-1 receiver holding every element once: bfloat16 on the wire, 2 bytes each
        assert state["bytes"] == 2 * _elements(export), state
        after_refit = generator.greedy()
        generator.load(export, version=5001)
        assert after_refit == generator.greedy()
    finally:
        generator.proc.stop()
        stack.cluster.procs.remove(generator.proc)
