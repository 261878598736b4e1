"""Training precision: float32 throughout, or bfloat16 parameters and compute with float32 masters.

With `bfloat16` the model's own parameters stay float32: they are the master weights that the
gradient sync and the optimizer (AdamW moments, Muon momenta) work on, as in FSDP2's mixed
precision or Megatron's fp32 main parameters. Each forward runs on bf16 casts of them (round to
nearest even), through a differentiable cast, so every microbatch's bf16 gradient is added to the
master's float32 `.grad` (accumulation over microbatches, the sync and the step stay in float32).
`weights` are persistent bf16 copies, refreshed after every optimizer step: bit for bit what the
forward computes with, and what the catalog declares, the refit sends and the export writes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.func import functional_call

from syncd.layout.dtypes import torch_dtype
from trainer_svc.settings import TRAIN_DTYPES


class Precision:
    def __init__(self, model: torch.nn.Module, dtype: str) -> None:
        if dtype not in TRAIN_DTYPES:
            raise ValueError(f"training dtype must be one of {', '.join(TRAIN_DTYPES)}, got {dtype!r}")
        self.model = model
        self.dtype = dtype
        self.torch_dtype = torch_dtype(dtype)
        self._masters = dict(model.named_parameters())
        self._weights: dict[str, torch.Tensor] | None = None
        if dtype != "float32":
            self._weights = {n: torch.empty_like(p, dtype=self.torch_dtype) for n, p in self._masters.items()}
            self.refresh()

    @property
    def weights(self) -> Mapping[str, torch.Tensor]:
        """The parameters the model computes with, by name (the masters themselves in float32)."""
        if self._weights is None:
            return {n: p.detach() for n, p in self._masters.items()}
        return self._weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._weights is None:
            return self.model(x)
        casts = {n: p.to(self.torch_dtype) for n, p in self._masters.items()}  # grads flow to the masters
        return functional_call(self.model, casts, (x,))

    @torch.no_grad()
    def refresh(self) -> None:
        """After the optimizer changed the masters: round them into the compute weights."""
        if self._weights is not None:
            for n, p in self._masters.items():
                self._weights[n].copy_(p)
