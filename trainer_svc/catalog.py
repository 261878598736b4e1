"""This rank's syncd catalog: every local parameter as boxes of canonical (HF, grouped-expert) tensors.

Each local tensor is `sharding.PLAN`'s placement of its canonical sources written as a syncd layout
expression; shard_cut.py executes the same table with torch slicing, and tests check the
two agree bit-exactly. Local tensor names are the trainer's parameter names. The fused expert-TP
gate/up weight `[E_l*2*I_l, H]` is registered under the view `[E_l, 2, I_l, H]` (same numel,
contiguous): two pieces, the local expert range of gate_proj and of up_proj, instead of 2*E_l
pieces.
"""

from __future__ import annotations

from syncd.layout import Canon, CanonicalTensor, Catalog, Sharded, Stack, local_tensor
from syncd.layout.placements import Expr
from trainer_svc.canonical import canonical_shapes
from trainer_svc.config import ModelArgs
from trainer_svc.parallel_dims import Coords, ParallelDims
from trainer_svc.parallelize import stage_layers
from trainer_svc.sharding import on_mesh, param_names, sharding_of, sources

MASTER_DTYPE = "float32"  # what the stage's parameters hold (`trainer_svc.precision`)


def build_catalog(args: ModelArgs, dims: ParallelDims, c: Coords, dtype: str = MASTER_DTYPE) -> Catalog:
    """The catalog of the rank at `c`: its pipeline stage's parameters held in `dtype` (the masters,
    or the weights the model computes with), all canonical tensors declared."""
    shapes = canonical_shapes(args)
    canonical = tuple(CanonicalTensor(name, shape, dtype) for name, shape in shapes.items())
    tensors = tuple(
        local_tensor(name, dtype, layout_expr(name, shapes, dims, c))
        for name in param_names(_stage_canonical_names(args, dims, c))
    )
    catalog = Catalog(canonical, tensors)
    catalog.validate()
    return catalog


def layout_expr(param: str, shapes: dict[str, tuple[int, ...]], dims: ParallelDims, c: Coords) -> Expr:
    """Local parameter `param` of the rank at `c`, fused sources stacked on dim 1."""
    placements = sharding_of(param).placements
    parts = tuple(
        Sharded(Canon(name, shapes[name]), placements, on_mesh(dims), on_mesh(c)) for name in sources(param)
    )
    return Stack(1, parts) if len(parts) > 1 else parts[0]


def _stage_canonical_names(args: ModelArgs, dims: ParallelDims, c: Coords) -> list[str]:
    layers = stage_layers(args, dims.pp, c.pp)
    names = []
    for name in canonical_shapes(args):
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) in layers:
                names.append(name)
        elif (name == "model.embed_tokens.weight" and c.pp == 0) or (
            name in ("model.norm.weight", "lm_head.weight") and c.pp == dims.pp - 1
        ):
            names.append(name)
    return names
