"""DTensor layouts -> boxes, on 4 real gloo ranks against DTensor itself.

- Property test (hypothesis, `_placement_ranks.py`): random meshes, shapes and placements,
  `_StridedShard` of FSDP2's split factor and of others; accepted layouts' boxes reassemble
  `DTensor.full_tensor()` exactly, refused ones are refused on every rank by name.
- transformers' Qwen3-MoE parallelized as the example does (FSDP2, TP, FSDP2 + TP on 2 x 2), one
  training step: every rank's catalog (built-in names: fused experts -> grouped canonical
  tensors) reassembles the gathered checkpoint that transformers saves, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dtensor_harness import torchrun


def test_strided_shard_boxes_reassemble_full_tensor(tmp_path):
    count = tmp_path / "count"
    torchrun("_placement_ranks.py", str(count), env={"PLACEMENT_EXAMPLES": "80"})
    checked, refused = map(int, count.read_text().split())
    assert checked >= 50 and refused >= 1, (checked, refused)  # both kinds were really drawn


LAYOUTS = ["fsdp2", "tp", "fsdp2tp"]


@pytest.fixture(scope="module")
def reports(kv4_model, tmp_path_factory) -> Path:
    """Every layout's report, from one rank job (its ranks import torch and transformers once)."""
    out = tmp_path_factory.mktemp("reports")
    torchrun("_model_ranks.py", ",".join(LAYOUTS), str(kv4_model), str(out))
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_model_catalog_reassembles_the_gathered_checkpoint(layout, reports):
    report = json.loads((reports / f"{layout}.json").read_text())
    assert report["uncovered"] == [] and report["wrong"] == [], report
    assert len(report["grouped"]) == 12  # 4 layers x gate/up/down, from fused 3-D parameters
    placements = set(report["placements"].values())
    expected = {
        "fsdp2": "(Shard(dim=0),)",
        "tp": "(Shard(dim=1),)",  # o_proj, row-parallel
        "fsdp2tp": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",  # column-parallel under FSDP2
    }[layout]
    assert expected in placements, placements
