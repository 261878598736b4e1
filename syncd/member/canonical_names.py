"""Parameter name -> canonical tensors: which boxes of the generator's tensors a trainer's
(global, unsharded) parameter is.

The answer is a layout expression (`syncd.layout`) whose shape is the parameter's global shape:
`Canon(name, shape)` when the parameter is one canonical tensor, a `Concat`/`Stack` of them when it
is a fusion, a `Canon` box when it is one slice of a grouped tensor. Built in (`builtin_layout`):

- the HF names of dense models: a parameter named `model.*` or `lm_head.*` is the canonical tensor
  of that name (torch wrappers' prefixes such as `_orig_mod.` and `_checkpoint_wrapped_module.` are
  dropped first);
- Qwen3-MoE as transformers 5.x (and our trainer) hold it: `...mlp.experts.gate_up_proj [E, 2I, H]`
  is `[gate_proj; up_proj]` of the grouped canonical tensors on dim 1, and `...mlp.experts.down_proj
  [E, H, I]` is the grouped `down_proj`;
- per-expert HF names (`...experts.{e}.gate_proj.weight [I, H]`): expert `e`'s slice of the
  grouped tensor (`syncd.layout.hf_names`), the expert count taken from the model's own parameters.

Anything else needs the user's mapping (`names=` of `syncd.member.attach.attach`): a canonical
name (same shape) or an expression, per parameter, or a function of (name, global shape).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from syncd.layout import Box, Canon, Concat, hf_names
from syncd.layout.placements import Expr

Shape = tuple[int, ...]
# A user's mapping: per parameter a canonical name or an expression; or a function that returns
# one (or None: "not mine", the built-in rules then decide).
UserNames = Mapping[str, str | Expr] | Callable[[str, Shape], str | Expr | None]

_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_FUSED_EXPERTS = re.compile(r"^(?P<layer>.*\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)(?:\.weight)?$")
_PER_EXPERT = re.compile(
    r"^(?P<layer>.*\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def strip_wrappers(name: str) -> str:
    """`layers.0._checkpoint_wrapped_module.mlp...` -> `layers.0.mlp...`: the module's own name."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def expert_counts(shapes: Mapping[str, Shape]) -> dict[str, int]:
    """Per MoE layer prefix (`model.layers.L.mlp`), how many per-expert parameters it numbers."""
    counts: dict[str, int] = {}
    for name in shapes:
        m = _PER_EXPERT.match(strip_wrappers(name))
        if m:
            counts[m["layer"]] = max(counts.get(m["layer"], 0), int(m["expert"]) + 1)
    return counts


def builtin_layout(name: str, shape: Shape, experts: Mapping[str, int]) -> Expr | None:
    """The built-in rules (module docstring); None when none applies."""
    name = strip_wrappers(name)
    if not name.startswith(("model.", "lm_head.")):
        return None
    fused = _FUSED_EXPERTS.match(name)
    if fused and len(shape) == 3:
        layer = fused["layer"]
        if fused["proj"] == "down_proj":
            return Canon(hf_names.grouped_expert_name(layer, "down_proj"), shape)
        e, two_i, h = shape
        if two_i % 2:
            return None
        half = (e, two_i // 2, h)
        return Concat(
            1,
            (
                Canon(hf_names.grouped_expert_name(layer, "gate_proj"), half),
                Canon(hf_names.grouped_expert_name(layer, "up_proj"), half),
            ),
        )
    per_expert = _PER_EXPERT.match(name)
    if per_expert and len(shape) == 2:
        layer, expert = per_expert["layer"], int(per_expert["expert"])
        grouped = (experts[layer], *shape)
        box = Box((expert, 0, 0), (expert + 1, *shape))
        return Canon(hf_names.grouped_expert_name(layer, per_expert["proj"]), grouped, box, drop=(0,))
    if fused:
        return None  # a fused expert tensor of another rank than 3: the user must say what it is
    return Canon(name, shape)


def layout_of(name: str, shape: Shape, user: UserNames | None, experts: Mapping[str, int]) -> Expr | None:
    """The expression of parameter `name` (global `shape`): the user's mapping first, then the
    built-in rules; None when neither names it."""
    mapped: str | Expr | None = None
    if callable(user):
        mapped = user(name, shape)
    elif user is not None:
        mapped = user.get(name)
    if isinstance(mapped, str):
        return Canon(mapped, shape)
    if mapped is not None:
        return mapped
    return builtin_layout(name, shape, experts)


def canonical_shapes(expr: Expr) -> dict[str, Shape]:
    """The canonical tensors an expression names, with their full shapes."""
    if isinstance(expr, Canon):
        return {expr.name: expr.canonical_shape}
    parts = getattr(expr, "parts", None)
    if parts is None:
        inner = getattr(expr, "expr", None)
        if inner is None:
            raise TypeError(f"unknown layout expression {type(expr).__name__}")
        return canonical_shapes(inner)
    out: dict[str, Shape] = {}
    for part in parts:
        out.update(canonical_shapes(part))
    return out
