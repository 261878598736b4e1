"""A small Qwen3-MoE-like model for the GPU tests (`testkit.synthetic_moe`), and its weights."""

from __future__ import annotations

import numpy as np

from testkit.synthetic_moe import MoeShape

SMALL_MOE = MoeShape(
    layers=2,
    hidden=256,
    experts=8,
    moe_inter=96,
    heads=8,
    kv_heads=2,
    head_dim=32,
    vocab=1024,
    dtype="float32",
)


def canonical(seed: int) -> dict[str, np.ndarray]:
    """Version `seed`'s weights of `SMALL_MOE`, by canonical name."""
    rng = np.random.default_rng(seed)
    return {c.name: rng.standard_normal(c.shape).astype(np.float32) for c in SMALL_MOE.canonical()}
