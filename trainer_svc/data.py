"""Deterministic synthetic training data, independent of the parallel layout.

Each sequence is an arithmetic progression modulo the vocab (random start and stride), so the
loss visibly falls. The global batch of a step depends only on (seed, step); every data rank
(dp x ep coordinates) takes its contiguous rows and splits them into microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Microbatch:
    inputs: torch.Tensor  # [b, S] token ids
    labels: torch.Tensor  # [b, S] next tokens


def global_batch(seed: int, step: int, batch: int, seq_len: int, vocab: int) -> torch.Tensor:
    """[batch, seq_len + 1] token ids for `step`."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 17, (batch, 1), generator=gen)
    return (start + stride * torch.arange(seq_len + 1)) % vocab


def local_microbatches(
    tokens: torch.Tensor, data_rank: int, data_ranks: int, microbatches: int, device: torch.device
) -> list[Microbatch]:
    batch = tokens.shape[0]
    if batch % (data_ranks * microbatches):
        raise ValueError(
            f"global batch size {batch} must be divisible by dp x ep {data_ranks} "
            f"x microbatches {microbatches}"
        )
    mine = tokens.chunk(data_ranks)[data_rank].to(device)
    return [Microbatch(mb[:, :-1], mb[:, 1:]) for mb in mine.chunk(microbatches)]
