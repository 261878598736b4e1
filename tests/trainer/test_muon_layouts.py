"""Muon trains the same model under every layout as on one process, and the layouts between them
take every communication path (local, all_gather, all_to_all, batched).

The tolerance is the issue's: relative Frobenius norm of every exported tensor below 1e-5
(float32), as for AdamW (test_layouts.py); losses agree to 1e-5 relative as well."""

from __future__ import annotations

import dataclasses

import pytest
from test_layouts import _assert_same_training

from trainer_svc.optim.muon_plan import ALL_GATHER, ALL_TO_ALL, BATCHED, LOCAL, PATHS
from trainer_svc.tiny import TINY_ARGS, make_tiny_checkpoint

# The tiny model with 4 kv heads (so tp 4 can split them) and 2 layers (pp 2 still has a layer
# per stage, and 8-rank layouts stay quick on 2 cores); 8 experts as before.
MUON_ARGS = dataclasses.replace(TINY_ARGS, num_key_value_heads=4, num_hidden_layers=2)

# (pp, dp, ep, tp) -> the path of each batch kind: q/k/v, o_proj, experts' gate+up, experts' down
EXPECTED_PATHS = {
    (1, 1, 1, 1): (LOCAL, LOCAL, LOCAL, LOCAL),
    (1, 1, 2, 2): (BATCHED, ALL_GATHER, ALL_TO_ALL, ALL_TO_ALL),  # 3 of q/k/v over 4 ranks
    (2, 1, 2, 1): (BATCHED, LOCAL, LOCAL, LOCAL),  # attention shared by the 2 ep replicas
    (1, 1, 1, 4): (BATCHED, ALL_GATHER, ALL_TO_ALL, ALL_TO_ALL),
    (1, 1, 4, 2): (BATCHED, ALL_GATHER, ALL_TO_ALL, ALL_TO_ALL),
    (1, 2, 2, 1): (BATCHED, LOCAL, ALL_TO_ALL, ALL_TO_ALL),  # dp replicas split the experts' NS
    (1, 2, 1, 2): (BATCHED, ALL_GATHER, ALL_TO_ALL, ALL_TO_ALL),  # owners over dp and tp at once
}
KINDS = (
    ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
    ("o_proj.weight",),
    ("gate_up_proj",),
    ("down_proj",),
)


@pytest.fixture(scope="session")
def muon_dir(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("muon-model"), seed=1, args=MUON_ARGS))


@pytest.fixture(scope="session")
def muon(muon_dir) -> dict:
    return {"optimizer": "muon", "model_dir": muon_dir}


@pytest.fixture(scope="session")
def muon_reference(run_layout, muon):
    return run_layout(1, 1, 1, 1, **muon)


def _kind_paths(paths: dict[str, str]) -> tuple[str, ...]:
    out = []
    for suffixes in KINDS:
        taken = {path for name, path in paths.items() if name.endswith(suffixes)}
        assert len(taken) == 1, (suffixes, taken)
        out.append(taken.pop())
    return tuple(out)


@pytest.mark.parametrize("layout", list(EXPECTED_PATHS), ids=lambda l: "pp{}dp{}ep{}tp{}".format(*l))
def test_muon_layout_matches_single_process(run_layout, muon, muon_reference, muon_dir, layout):
    ranks, export = run_layout(*layout, **muon)
    for r in ranks:
        assert _kind_paths(r.muon_paths) == EXPECTED_PATHS[layout], r.coords
    _assert_same_training(ranks, export, *muon_reference, muon_dir)


def test_the_layouts_exercise_every_path():
    assert {p for paths in EXPECTED_PATHS.values() for p in paths} == set(PATHS)


def test_muon_and_adamw_train_differently(run_layout, muon_dir, muon_reference):
    """The flag reaches the optimizer: same data, same start, different weights after 3 steps."""
    adamw_ranks, _ = run_layout(1, 1, 1, 1, model_dir=muon_dir)
    muon_ranks, _ = muon_reference
    name = "model.layers.0.mlp.experts.down_proj"
    assert not (adamw_ranks[0].params[name] - muon_ranks[0].params[name]).abs().max() < 1e-7
