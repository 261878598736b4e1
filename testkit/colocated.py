"""Both members of a refit on one GPU: the synthetic MoE of `shape_for(gib)` in the expert-TP
trainer layout (one rank) into vLLM's layout (TP 1), planned in 512 MiB buckets. Used by
`bench/colocated_bench.py --device cuda` and the CUDA IPC tests (`tests/gpu/ipc_peer.py`)."""

from __future__ import annotations

import torch

from syncd.layout import Catalog
from syncd.layout.dtypes import torch_dtype
from syncd.plan import DestMember, SourceMember, TransferUnit, make_plan
from testkit.synthetic_moe import shape_for, trainer_catalog, vllm_catalog


def plan_units(gib: float) -> tuple[Catalog, Catalog, list[TransferUnit]]:
    """The sender's catalog, the receiver's, and every unit of the plan between them."""
    shape = shape_for(gib)
    src_cat, dst_cat = trainer_catalog(shape, 1, 0, 1, 0), vllm_catalog(shape, 1, 0)
    plan = make_plan(
        [SourceMember("trainer", 0, src_cat)], [DestMember("generator", dst_cat)], bucket_bytes=512 << 20
    )
    return src_cat, dst_cat, [u for b in plan.buckets for u in b.units]


def source_tensors(gib: float) -> dict[str, torch.Tensor]:
    """The sender's weights on the GPU, drawn from seed 0: the same bits in every process."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    return {
        t.name: torch.randn(t.shape, generator=gen, device="cuda").to(torch_dtype(t.dtype))
        for t in plan_units(gib)[0].tensors
    }
