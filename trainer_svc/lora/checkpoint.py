"""An adapter as whole tensors, and the base merged with it: the reference a refit must equal.

`load_adapter(dir)` reassembles the shards `LoraAdapters.save_shards` wrote (one file per dp-0
rank) into whole factors, placed back by `sharding.PLAN` as `shard_gather` places the base, and
names them canonically: `<weight without .weight>.lora_A.weight` / `.lora_B.weight`, grouped
experts split per projection (`model.layers.L.mlp.experts.gate_proj.lora_A.weight [E, r, H]`).
`merge_checkpoint` merges them into a base's canonical tensors with `merge.merge_lora`, the
arithmetic the trainer's ranks use on their shards, so its result is bit-exact with what they send.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from syncd.layout import Shard
from trainer_svc.lora.merge import merge_lora
from trainer_svc.sharding import sharding_of

A, B = ".lora_A.weight", ".lora_B.weight"
_FUSED_GATE_UP = ".mlp.experts.gate_up_proj_lora_"


@dataclass(frozen=True)
class Adapter:
    rank: int
    alpha: float
    tensors: dict[str, torch.Tensor]  # canonical adapter name -> whole factor (float32)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def targets(self) -> list[str]:
        """The canonical base tensors this adapter changes."""
        return sorted(n.removesuffix(A) + ".weight" for n in self.tensors if n.endswith(A))


def load_adapter(directory: str | Path) -> Adapter:
    """The adapter whose shards lie in `directory` (an export's `adapter-rank*.safetensors`)."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("adapter-rank*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no adapter shards (adapter-rank*.safetensors) in {directory}")
    pieces: dict[str, dict[tuple[int, int], torch.Tensor]] = defaultdict(dict)
    meta: dict[str, str] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata()
            place = int(meta["ep"]), int(meta["tp"])
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                pieces[name][place] = f.get_tensor(name)
    sizes = int(meta["ep_size"]), int(meta["tp_size"])
    tensors: dict[str, torch.Tensor] = {}
    for name, by_place in pieces.items():
        tensors.update(_canonical(name, _whole(name, by_place, sizes)))
    return Adapter(int(meta["rank"]), float(meta["alpha"]), tensors)


def _whole(name: str, pieces: dict[tuple[int, int], torch.Tensor], sizes: tuple[int, int]) -> torch.Tensor:
    """Undo the cut of factor `name`: over tp within each ep coordinate, then over ep."""
    ep_p, tp_p = sharding_of(name).placements
    ep_size, tp_size = sizes

    def over_tp(ep: int) -> torch.Tensor:
        if isinstance(tp_p, Shard):
            return torch.cat([pieces[(ep, tp)] for tp in range(tp_size)], tp_p.dim)
        return pieces[(ep, 0)]

    if isinstance(ep_p, Shard):
        return torch.cat([over_tp(ep) for ep in range(ep_size)], ep_p.dim)
    return over_tp(0)


def _canonical(name: str, whole: torch.Tensor) -> dict[str, torch.Tensor]:
    if _FUSED_GATE_UP in name:  # [E, 2, ...]: gate's and up's own factors
        layer, factor = name.split(_FUSED_GATE_UP)
        return {
            f"{layer}.mlp.experts.{proj}.lora_{factor}.weight": whole[:, i].contiguous()
            for i, proj in enumerate(("gate_proj", "up_proj"))
        }
    if ".mlp.experts.down_proj_lora_" in name:
        layer, factor = name.split(".mlp.experts.down_proj_lora_")
        return {f"{layer}.mlp.experts.down_proj.lora_{factor}.weight": whole}
    return {f"{name}.weight": whole}


def merge_checkpoint(
    base: dict[str, torch.Tensor], adapter: Adapter, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """`base` (canonical tensors) with every target merged into `dtype`; the rest as they are."""
    out = dict(base)
    for target in adapter.targets():
        stem = target.removesuffix(".weight")
        out[target] = merge_lora(
            base[target], adapter.tensors[stem + A], adapter.tensors[stem + B], adapter.scale, dtype
        )
    return out
