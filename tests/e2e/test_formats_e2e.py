"""Serving bfloat16 end to end, as users run it (real processes), into a TP-1 and a TP-2 bfloat16
vLLM generator at once (two engines shared by the module):
- a bfloat16 trainer (float32 masters) refits both after every step, and after each refit each
  generates exactly as vLLM's own loader makes it on the trainer's bfloat16 export of that step
  (the generator itself after `/v1/weights/load` of the export: tests/generator shows that such a
  load generates exactly as a fresh engine); for the trainer layouts (1,2,2) and (2,2,1) (the
  TP-2 generator's workers each take their own shards, w13 halves included, from ep-2 ranks);
- a float32 trainer refits them with the sender rounding to bfloat16 (to nearest even, as the
  export does): exactly its bfloat16 export, with 2 bytes per weight on the wire, half of float32
  (the refit's bytes equal the generators' bfloat16 parameter bytes, and the TP-1 generator's are
  twice the export's element count).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from e2e_harness import Generator, Stack
from safetensors import safe_open

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

TRAINERS = 4  # every layout below has four ranks
GENERATOR_WORKERS = 1 + 2  # a TP-1 and a TP-2 generator


def _elements(checkpoint: Path) -> int:
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 - safe_open is not iterable


def _catalog_bytes(generator: Generator) -> int:
    """The bytes of the parameters a generator registered (its `/metrics` gauge)."""
    for line in generator.http.get("/metrics").text.splitlines():
        if line.startswith("weightsync_generator_catalog_bytes "):
            return int(float(line.split()[1]))
    raise AssertionError("no weightsync_generator_catalog_bytes on /metrics")


@pytest.fixture(scope="module")
def generators(stack: Stack, model: Path) -> dict[int, Generator]:
    """By TP size; they re-register with each test's syncd."""
    stack.start_syncd(trainers=TRAINERS, generators=GENERATOR_WORKERS, db="generators.db")
    return {
        tp: stack.start_generator(model, tp=tp, replica=tp - 1, name=f"generator-bf16-tp{tp}")
        for tp in (1, 2)
    }


def _check_as_vllm_loads(generators: dict[int, Generator], served: dict[int, list], export: Path) -> None:
    """What each generator served after the refit of step N is what it serves once vLLM's own
    loader loaded step N's export (checked after all refits: a load changes what it serves)."""
    for tp, generator in generators.items():
        for step, after_refit in enumerate(served[tp], start=1):
            generator.load(export / f"step-{step}", version=9000 + step)
            assert after_refit == generator.greedy(), f"step {step}, TP {tp}"


@pytest.mark.parametrize("layout", [(1, 2, 2), (2, 2, 1)], ids=["pp1-ep2-tp2", "pp2-ep2-tp1"])
def test_a_bfloat16_trainer_refit_generates_as_vllm_on_its_export_after_every_step(
    stack, generators, model, tmp_path, layout
):
    pp, ep, ttp = layout
    steps = 2
    stack.start_syncd(trainers=TRAINERS, generators=GENERATOR_WORKERS, db=f"{tmp_path.name}.db")
    trainer = stack.train(model, pp=pp, ep=ep, tp=ttp, steps=steps, export=tmp_path / "export")
    served: dict[int, list] = {tp: [] for tp in generators}
    for step in range(1, steps + 1):
        stack.wait_announced(step)
        state = stack.refit(step)
        assert state["state"] == "COMMITTED", state
        for tp, generator in generators.items():
            served[tp].append(generator.greedy())
    assert trainer.popen.wait(180) == 0, trainer.tail()
    _check_as_vllm_loads(generators, served, tmp_path / "export")


def test_a_float32_trainer_refits_bfloat16_generators_with_half_the_bytes(stack, generators, model, tmp_path):
    stack.start_syncd(trainers=TRAINERS, generators=GENERATOR_WORKERS, db="float32-trainer.db")
    trainer = stack.train(
        model, pp=1, ep=2, tp=2, steps=1, export=tmp_path / "export", dtype="float32", export_dtype="bfloat16"
    )
    stack.wait_announced(1)
    state = stack.refit(1)
    assert trainer.popen.wait(180) == 0, trainer.tail()
    assert state["state"] == "COMMITTED", state
    # bfloat16 on the wire: the refit moved exactly the generators' bfloat16 parameter bytes, and
    # the TP-1 generator, which holds every element once, holds 2 bytes per element.
    assert state["bytes"] == sum(_catalog_bytes(g) for g in generators.values()), state
    assert _catalog_bytes(generators[1]) == 2 * _elements(tmp_path / "export" / "step-1")
    served = {tp: [g.greedy()] for tp, g in generators.items()}
    _check_as_vllm_loads(generators, served, tmp_path / "export")
