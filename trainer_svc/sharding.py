"""The trainer's sharding, declared once: `PLAN` maps each local parameter to the canonical
tensors it holds and their placements over the (ep, tp) mesh dims, as torchtitan's per-model
parallelize plans map modules to DTensor placements. pp holds whole layers (`stage_layers`) and
dp replicates, so neither appears here.

Everything that cuts, describes or reassembles a shard reads this table, and nothing else states
a placement:
- `catalog.py`: each local tensor's syncd layout expression (`Sharded` over (ep, tp)),
- `shard_cut.py` / `shard_gather.py`: cutting canonical tensors into a rank's parameters and
  gathering them back (also for `parallel_export.py`),
- `parallelize.py`: which groups a gradient is summed over, and how many ranks then hold it,
- `optim/optimizer.py`: which parameters are Muon's matrices and which of their dims is cut.
`model.py` builds its parameters in these local shapes. Tests check the table's two executions
(syncd expressions, torch slicing) against each other, and every layout's training against one
process's, which a wrong entry would break.

Placements apply in mesh-dim order, each to what the previous one left, on every canonical
source of the parameter. Splits are even (`ParallelDims.validate` requires it): torch's `chunk`
and syncd's `Shard` then cut alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from syncd.layout import Replicate, Shard, hf_names
from syncd.layout.placements import Placement
from trainer_svc.parallel_dims import Coords, ParallelDims


@dataclass(frozen=True)
class ParamSharding:
    """How one local parameter is placed. `fused`: the grouped expert projections it holds (else
    it holds the canonical tensor of its own name); two or more are stacked on a new dim 1, after
    the expert dim, and flattened to 2-D, so one matmul computes them all (`moe.py`).
    `tp_partial_grad`: replicated over tp, but each tp rank's gradient covers only its own
    heads, so gradients are summed over tp too."""

    placements: tuple[Placement, Placement] = (Replicate(), Replicate())  # over (ep, tp)
    fused: tuple[str, ...] = ()
    tp_partial_grad: bool = False

    @property
    def ep_dim(self) -> int | None:
        return _dim(self.placements[0])

    @property
    def tp_dim(self) -> int | None:
        return _dim(self.placements[1])


def _dim(p: Placement) -> int | None:
    return p.dim if isinstance(p, Shard) else None


REPLICATED = ParamSharding()
COLWISE = ParamSharding((Replicate(), Shard(0)))
ROWWISE = ParamSharding((Replicate(), Shard(1)))

# Local parameter name suffix -> placement; parameters matching none are replicated.
PLAN: dict[str, ParamSharding] = {
    ".self_attn.q_proj.weight": COLWISE,
    ".self_attn.k_proj.weight": COLWISE,
    ".self_attn.v_proj.weight": COLWISE,
    ".self_attn.o_proj.weight": ROWWISE,
    ".self_attn.q_norm.weight": ParamSharding(tp_partial_grad=True),
    ".self_attn.k_norm.weight": ParamSharding(tp_partial_grad=True),
    # whole experts over ep, the intermediate dim over tp: [E, I, H] and [E, H, I]
    ".experts.gate_up_proj": ParamSharding((Shard(0), Shard(1)), fused=("gate_proj", "up_proj")),
    ".experts.down_proj": ParamSharding((Shard(0), Shard(2)), fused=("down_proj",)),
    # LoRA factors (`trainer_svc.lora.layers`), placed like the weight they adapt: B shares a
    # column-parallel weight's rows, A a row-parallel weight's columns; the other factor is
    # replicated over tp and its gradient is partial there (each tp rank sees its own shard's part).
    ".q_proj.lora_A": ParamSharding(tp_partial_grad=True),
    ".q_proj.lora_B": COLWISE,
    ".k_proj.lora_A": ParamSharding(tp_partial_grad=True),
    ".k_proj.lora_B": COLWISE,
    ".v_proj.lora_A": ParamSharding(tp_partial_grad=True),
    ".v_proj.lora_B": COLWISE,
    ".o_proj.lora_A": ROWWISE,
    ".o_proj.lora_B": ParamSharding(tp_partial_grad=True),
    # [E, 2, r, H], [E, 2, I, r], [E, r, I], [E, H, r]: whole experts over ep, I over tp
    ".experts.gate_up_proj_lora_A": ParamSharding((Shard(0), Replicate()), tp_partial_grad=True),
    ".experts.gate_up_proj_lora_B": ParamSharding((Shard(0), Shard(2))),
    ".experts.down_proj_lora_A": ParamSharding((Shard(0), Shard(2))),
    ".experts.down_proj_lora_B": ParamSharding((Shard(0), Replicate()), tp_partial_grad=True),
}
_FUSED_INTO = {proj: suffix for suffix, s in PLAN.items() for proj in s.fused}


def sharding_of(param: str) -> ParamSharding:
    for suffix, sharding in PLAN.items():
        if param.endswith(suffix):
            return sharding
    return REPLICATED


def sources(param: str) -> tuple[str, ...]:
    """The canonical tensors local parameter `param` holds, in stacking order."""
    fused = sharding_of(param).fused
    if not fused:
        return (param,)
    experts = param.rpartition(".")[0]  # "model.layers.L.mlp.experts"
    return tuple(hf_names.grouped_expert_name(experts.removesuffix(".experts"), proj) for proj in fused)


def param_names(canonical: list[str]) -> list[str]:
    """The local parameters holding `canonical` tensors, in the order of their first source."""
    out: dict[str, None] = {}
    for name in canonical:
        if hf_names.is_grouped_expert(name):
            experts, proj, _ = name.rsplit(".", 2)
            name = experts + _FUSED_INTO[proj].removeprefix(".experts")
        out[name] = None
    return list(out)


def on_mesh(x: ParallelDims | Coords) -> tuple[int, int]:
    """The sizes (of `ParallelDims`) or coordinates (of `Coords`) that placements refer to."""
    return x.ep, x.tp


def local_shape(param: str, shapes: Mapping[str, tuple[int, ...]], dims: ParallelDims) -> tuple[int, ...]:
    """The rank's shape of `param`, fused sources still stacked ([E_l, 2, I_l, H] for gate/up)."""
    sharding = sharding_of(param)
    srcs = sources(param)
    shape = list(shapes[srcs[0]])
    for p, size in zip(sharding.placements, on_mesh(dims)):
        if isinstance(p, Shard):
            shape[p.dim] //= size
    if len(srcs) > 1:
        shape.insert(1, len(srcs))
    return tuple(shape)
