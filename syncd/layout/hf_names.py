"""The canonical naming convention: HF checkpoint names, with routed experts grouped per layer.

Hugging Face checkpoints of MoE models store one tensor per expert
(`model.layers.3.mlp.experts.17.gate_proj.weight [I, H]`). Every catalog in this project instead
names the grouped tensor (`model.layers.3.mlp.experts.gate_proj.weight [E, I, H]`): metadata then
grows with layers, not layers x experts, which keeps a 671B model's catalogs small and its plan
fast. These helpers are the only place that converts between the two spellings.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar


class _Indexable(Protocol):
    def __getitem__(self, index: int, /) -> Any: ...


# A tensor or array: split along experts by indexing, grouped by the caller's `stack`.
T = TypeVar("T", bound=_Indexable)

# `weight_scale_inv`: the block scales of a blockwise-FP8 weight (`syncd.plan.fp8_blocks`), which
# an FP8 checkpoint also stores per expert.
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<kind>weight(?:_scale_inv)?)$"
)
_GROUPED = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<kind>weight(?:_scale_inv)?)$"
)


def grouped_expert_name(layer_prefix: str, proj: str) -> str:
    """`grouped_expert_name("model.layers.3.mlp", "gate_proj")` -> the canonical grouped name."""
    return f"{layer_prefix}.experts.{proj}.weight"


def is_grouped_expert(name: str) -> bool:
    return _GROUPED.match(name) is not None


def hf_expert_name(grouped: str, expert: int) -> str:
    m = _GROUPED.match(grouped)
    if m is None:
        raise ValueError(f"{grouped} is not a grouped expert tensor name")
    return f"{m['prefix']}.{expert}.{m['proj']}.{m['kind']}"


def split_to_hf(name: str, tensor: T, num_experts: int) -> list[tuple[str, T]]:
    """Canonical (name, tensor) -> HF (name, tensor) pairs; grouped experts become per-expert views."""
    if not is_grouped_expert(name):
        return [(name, tensor)]
    return [(hf_expert_name(name, e), tensor[e]) for e in range(num_experts)]


def group_from_hf(items: Iterable[tuple[str, T]], stack: Callable[[Sequence[T]], T]) -> dict[str, T]:
    """HF (name, tensor) pairs -> canonical tensors, stacking per-expert tensors in expert order.
    Raises ValueError when a layer's experts are not numbered 0..E-1."""
    out: dict[str, T] = {}
    experts: dict[str, dict[int, T]] = {}
    for name, tensor in items:
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = tensor
        else:
            experts.setdefault(f"{m['prefix']}.{m['proj']}.{m['kind']}", {})[int(m["expert"])] = tensor
    for grouped, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"{grouped}: experts {sorted(by_index)} are not numbered 0..{len(by_index) - 1}")
        out[grouped] = stack([by_index[e] for e in range(len(by_index))])
    return out


def canonical_shapes_from_hf(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Like `group_from_hf` for shapes only (e.g. from a safetensors header)."""
    return group_from_hf(shapes.items(), lambda parts: (len(parts), *parts[0]))
