"""What a LoRA run trains: rank, alpha and the target modules."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LoraTarget(enum.StrEnum):
    """Target modules, by the generator layers they change as a whole: a refit of merged weights
    must fill every tensor of each layer it changes (vLLM fuses q/k/v as qkv_proj and the experts'
    gate/up as w13), so targets come in these groups."""

    ATTENTION = "attention"  # q_proj, k_proj, v_proj, o_proj
    EXPERTS = "experts"  # every routed expert's gate_proj, up_proj, down_proj

    @property
    def projections(self) -> tuple[str, ...]:
        if self is LoraTarget.ATTENTION:
            return ("q_proj", "k_proj", "v_proj", "o_proj")
        return ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float = 16.0
    targets: tuple[LoraTarget, ...] = (LoraTarget.ATTENTION, LoraTarget.EXPERTS)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoRA targets must be distinct and at least one, got {self.targets}")
        object.__setattr__(self, "targets", tuple(LoraTarget(t) for t in self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
