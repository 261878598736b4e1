"""This rank's syncd catalog: every local parameter as boxes of canonical (HF, grouped-expert) tensors.

Written with syncd's layout expressions, independently of the tensor slicing in
state_dict_adapter.py; tests check the two agree bit-exactly. Local tensor names are the trainer's
parameter names. The fused expert-TP gate/up weight `[E_l*2*I_l, H]` is registered under the view
`[E_l, 2, I_l, H]` (same numel, contiguous): two pieces, the local expert range of gate_proj and
of up_proj, instead of 2*E_l pieces. `gate_up_interleaved_expr` is the equivalent 2-D description
(InterleavedShard over tp); a test checks both map every element identically.
"""

from __future__ import annotations

from syncd.layout import (
    Box,
    Canon,
    CanonicalTensor,
    Catalog,
    Concat,
    InterleavedShard,
    LocalTensor,
    Piece,
    Shard,
    Sharded,
    local_tensor,
)
from syncd.layout.hf_names import grouped_expert_name
from trainer_svc.config import ModelArgs
from trainer_svc.parallel_dims import Coords, ParallelDims
from trainer_svc.parallelize import stage_layers
from trainer_svc.state_dict_adapter import COLUMN_PARALLEL, ROW_PARALLEL, canonical_shapes

MASTER_DTYPE = "float32"  # what the stage's parameters hold (`trainer_svc.precision`)


def build_catalog(args: ModelArgs, dims: ParallelDims, c: Coords, dtype: str = MASTER_DTYPE) -> Catalog:
    """The catalog of the rank at `c`: its pipeline stage's parameters held in `dtype` (the masters,
    or the weights the model computes with), all canonical tensors declared."""
    shapes = canonical_shapes(args)
    canonical = tuple(CanonicalTensor(name, shape, dtype) for name, shape in shapes.items())
    tensors: list[LocalTensor] = []
    for name in _stage_canonical_names(args, dims, c):
        shape = shapes[name]
        if name.endswith(".experts.up_proj.weight") or name.endswith(".experts.down_proj.weight"):
            continue  # covered by the fused gate_up entry, or below
        if name.endswith(".experts.gate_proj.weight"):
            prefix = name[: -len(".experts.gate_proj.weight")]
            tensors.append(gate_up_view_tensor(prefix, args, dims, c, dtype))
            down = grouped_expert_name(prefix, "down_proj")
            expr = Sharded(Canon(down, shapes[down]), (Shard(0), Shard(2)), (dims.ep, dims.tp), (c.ep, c.tp))
            tensors.append(local_tensor(f"{prefix}.experts.down_proj", dtype, expr))
        elif name.endswith(COLUMN_PARALLEL):
            tensors.append(local_tensor(name, dtype, Sharded(Canon(name, shape), (Shard(0),), (dims.tp,), (c.tp,))))
        elif name.endswith(ROW_PARALLEL):
            tensors.append(local_tensor(name, dtype, Sharded(Canon(name, shape), (Shard(1),), (dims.tp,), (c.tp,))))
        else:
            tensors.append(local_tensor(name, dtype, Canon(name, shape)))
    catalog = Catalog(canonical, tuple(tensors))
    catalog.validate()
    return catalog


def _stage_canonical_names(args: ModelArgs, dims: ParallelDims, c: Coords) -> list[str]:
    layers = stage_layers(args, dims.pp, c.pp)
    names = []
    for name in canonical_shapes(args):
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) in layers:
                names.append(name)
        elif name == "model.embed_tokens.weight" and c.pp == 0:
            names.append(name)
        elif name in ("model.norm.weight", "lm_head.weight") and c.pp == dims.pp - 1:
            names.append(name)
    return names


def gate_up_view_tensor(prefix: str, args: ModelArgs, dims: ParallelDims, c: Coords,
                        dtype: str = MASTER_DTYPE) -> LocalTensor:
    """`{prefix}.experts.gate_up_proj` as the view [E_l, 2, I_l, H]: projection p (0 gate, 1 up)
    of the local experts is box [:, p, :, :], holding this rank's ep/tp shard of that projection."""
    E, I, H = args.num_experts, args.moe_intermediate_size, args.hidden_size
    E_l, I_l = E // dims.ep, I // dims.tp
    pieces = []
    for p, proj in enumerate(("gate_proj", "up_proj")):
        name = grouped_expert_name(prefix, proj)
        expr = Sharded(Canon(name, (E, I, H)), (Shard(0), Shard(1)), (dims.ep, dims.tp), (c.ep, c.tp))
        (piece,) = expr.pieces()
        pieces.append(Piece(name, piece.canon, Box((0, p, 0, 0), (E_l, p + 1, I_l, H))))
    return LocalTensor(f"{prefix}.experts.gate_up_proj", (E_l, 2, I_l, H), dtype, tuple(pieces))


def gate_up_interleaved_expr(prefix: str, args: ModelArgs, dims: ParallelDims, c: Coords) -> Sharded:
    """The same holding on the parameter's own 2-D shape [E_l*2*I_l, H]: the concatenation
    [gate_0; up_0; gate_1; up_1; ...] sharded over ep (whole experts), then InterleavedShard over tp
    with one stripe per local (expert, projection)."""
    E, I, H = args.num_experts, args.moe_intermediate_size, args.hidden_size
    parts = []
    for e in range(E):
        for proj in ("gate_proj", "up_proj"):
            box = Box((e, 0, 0), (e + 1, I, H))
            parts.append(Canon(grouped_expert_name(prefix, proj), (E, I, H), box, drop=(0,)))
    E_l = E // dims.ep
    placements = (Shard(0), InterleavedShard(0, stripes=E_l * 2))
    return Sharded(Concat(0, tuple(parts)), placements, (dims.ep, dims.tp), (c.ep, c.tp))
