"""A stage's LoRA adapters: attached over the frozen base, merged for refits, saved as shards.

Lifecycle (`trainer_svc.train.Trainer`): `LoraAdapters.attach` swaps the target modules of the
stage for their LoRA forms (`layers.py`) before the precision wrapper and the optimizer see the
parameters, freezes every base parameter and draws each A from a generator seeded by the run's
seed and the factor's name, whole, then cut like the base (so every layout starts from the same
adapter); B starts at zero, so step 0 is the base. After every optimizer step, under the trainer's
lock, `refresh` merges each target weight (`merge.merge_lora`) into `merged`: buffers in the base
parameter's local shape and the served dtype, which the rank's refit catalog (`refit_catalog`,
partial: only the target modules' canonical tensors) exposes to syncd and the export writes in
place of the base. `save_shards` writes the factors of every dp-0 rank next to an export;
`trainer_svc.lora.checkpoint` reassembles them.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from syncd.layout import Catalog, Shard
from trainer_svc.lora.config import LoraConfig, LoraTarget
from trainer_svc.lora.layers import LoraGroupedExperts, LoraLinear
from trainer_svc.lora.merge import merge_lora
from trainer_svc.moe import GroupedExperts
from trainer_svc.parallel_dims import Coords, ParallelDims
from trainer_svc.sharding import on_mesh, sharding_of

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# target parameter's suffix -> its factors' suffixes (A, B)
EXPERT_FACTORS = {
    ".mlp.experts.gate_up_proj": (".mlp.experts.gate_up_proj_lora_A", ".mlp.experts.gate_up_proj_lora_B"),
    ".mlp.experts.down_proj": (".mlp.experts.down_proj_lora_A", ".mlp.experts.down_proj_lora_B"),
}
SHARD_FILE = "adapter-rank{rank:05d}.safetensors"


@dataclass(frozen=True)
class _Target:
    """One target weight: its local parameter and factor names, and the shape that B @ A has
    (the fused gate/up weight [E_l*2*I_l, H] merges as [E_l, 2, I_l, H])."""

    weight: str
    lora_a: str
    lora_b: str
    merge_shape: tuple[int, ...]


class LoraAdapters:
    def __init__(
        self,
        config: LoraConfig,
        params: Mapping[str, nn.Parameter],
        targets: list[_Target],
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self._params = dict(params)
        self.targets = targets
        self.dtype = dtype  # the served dtype, which the merged weights are in
        self.merged: dict[str, torch.Tensor] = {}  # target weight -> merged, once `refresh` ran

    @staticmethod
    def attach(
        model: nn.Module,
        config: LoraConfig,
        dims: ParallelDims,
        coords: Coords,
        seed: int,
        dtype: torch.dtype,
    ) -> LoraAdapters:
        """Swap in the LoRA forms of `config.targets`, freeze the base, draw every A (module
        docstring). `dtype`: what the merged weights are served in."""
        for layer in model.get_submodule("model.layers").children():
            if LoraTarget.ATTENTION in config.targets:
                for proj in ATTENTION_PROJECTIONS:
                    base = getattr(layer.self_attn, proj)
                    setattr(layer.self_attn, proj, LoraLinear(base.weight, config.rank, config.scale))
            if LoraTarget.EXPERTS in config.targets:
                mlp = layer.get_submodule("mlp")
                experts = mlp.get_submodule("experts")
                assert isinstance(experts, GroupedExperts)  # the stage's MoE block (`moe.py`)
                mlp.experts = LoraGroupedExperts(experts, config.rank, config.scale)
        params = dict(model.named_parameters())
        targets = _targets(params)
        factors = {t.lora_a for t in targets} | {t.lora_b for t in targets}
        with torch.no_grad():
            for name, p in params.items():
                p.requires_grad_(name in factors)
                if name in {t.lora_a for t in targets}:
                    p.copy_(_draw_a(name, p.shape, dims, coords, seed))
        return LoraAdapters(config, params, targets, dtype)

    @torch.no_grad()
    def refresh(self) -> None:
        """Merge every target weight from the float32 parameters (the masters) into `merged`,
        allocated (again) where the parameters live; the views handed out stay valid after."""
        for t in self.targets:
            w = self._params[t.weight]
            if t.weight not in self.merged or self.merged[t.weight].device != w.device:
                self.merged[t.weight] = torch.empty_like(w, dtype=self.dtype)
            a, b = self._params[t.lora_a], self._params[t.lora_b]
            merged = merge_lora(w.view(t.merge_shape), a, b, self.config.scale, self.dtype)
            self.merged[t.weight].copy_(merged.view(w.shape))

    def served(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The base's `weights` by name with every target replaced by its merged weight and the
        factors left out: the model a generator serves, for an export."""
        factors = self.factors()
        return {n: self.merged.get(n, w) for n, w in weights.items() if n not in factors}

    def factors(self) -> dict[str, torch.Tensor]:
        """This rank's adapter factors by local parameter name (float32, detached)."""
        return {n: self._params[n].detach() for t in self.targets for n in (t.lora_a, t.lora_b)}

    def refit_catalog(self, catalog: Catalog) -> Catalog:
        """`catalog` (the rank's, in the served dtype) cut to the target weights, partial: a refit
        moves only what the adapters change; the generators keep the frozen base they serve."""
        tensors = tuple(t for t in catalog.tensors if t.name in self.merged)
        used = {p.canonical for t in tensors for p in t.pieces}
        canonical = tuple(c for c in catalog.canonical if c.name in used)
        out = replace(catalog, canonical=canonical, tensors=tensors, partial=True)
        out.validate()
        return out

    def save_shards(self, out_dir: str | Path, dims: ParallelDims, coords: Coords, rank: int) -> None:
        """Write this rank's factors (dp replicas do not), with its mesh place, for
        `trainer_svc.lora.checkpoint.load_adapter`."""
        if coords.dp != 0:
            return
        from safetensors.torch import save_file

        meta: dict[str, float] = {"ep": coords.ep, "tp": coords.tp, "ep_size": dims.ep, "tp_size": dims.tp}
        meta |= {"rank": self.config.rank, "alpha": self.config.alpha}
        tensors = {n: t.contiguous().cpu() for n, t in self.factors().items()}
        save_file(
            tensors, str(Path(out_dir) / SHARD_FILE.format(rank=rank)), {k: str(v) for k, v in meta.items()}
        )


def _targets(params: Mapping[str, nn.Parameter]) -> list[_Target]:
    """Every adapted weight of the stage, found by its factors' names."""
    pairs = [
        (n.removesuffix(".lora_A") + ".weight", n, n.removesuffix(".lora_A") + ".lora_B")
        for n in params
        if n.endswith(".lora_A")
    ]
    for name in params:
        for weight, (a, b) in EXPERT_FACTORS.items():
            if name.endswith(a):
                layer = name.removesuffix(a)
                pairs.append((layer + weight, name, layer + b))
    return [_Target(w, a, b, (*params[b].shape[:-1], params[a].shape[-1])) for w, a, b in pairs]


def whole_shape(name: str, local: tuple[int, ...], dims: ParallelDims) -> tuple[int, ...]:
    """The shape of factor `name` over the whole mesh (its local shape times its shards)."""
    shape = list(local)
    for p, size in zip(sharding_of(name).placements, on_mesh(dims)):
        if isinstance(p, Shard):
            shape[p.dim] *= size
    return tuple(shape)


def _draw_a(name: str, local: torch.Size, dims: ParallelDims, coords: Coords, seed: int) -> torch.Tensor:
    """Factor A of `name`, drawn whole (N(0, 1/in)) and cut to this rank, as the base is."""
    shape = whole_shape(name, tuple(local), dims)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
    for p, size, coord in zip(sharding_of(name).placements, on_mesh(dims), on_mesh(coords)):
        if isinstance(p, Shard):
            t = t.chunk(size, p.dim)[coord]
    return t
