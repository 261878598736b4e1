"""FP8 blockwise weights as the planner sees them: the block grid, and which source layouts it
accepts.

A blockwise-FP8 generator (DeepSeek-V3 / Qwen3-FP8 checkpoints: `quantization_config` fp8 with
`weight_block_size [128, 128]`) holds each quantized weight as e4m3 values plus a float32
`weight_scale_inv` with one entry per 128x128 block of the weight's last two dims (grouped expert
tensors `[E, N, K]` have one grid per expert). Blocks at the end of a dim that is not a multiple of
128 are smaller; they still get one scale each. `syncd.dataplane.fp8.quantize_blockwise` is the
reference quantizer.

Decision: a trainer shard boundary inside a block is REFUSED, by `require_whole_blocks`, naming
the tensor, the member, the dim and the cut. Why: a block's scale is a function of the whole
block (its amax), so the sender that quantizes a block must hold all of it. Handling a split block
would need the trainer ranks sharing it to agree on its amax before packing (a MAX all-reduce in
the trainer's TP group, per refit): a data-dependent step on the trainer that syncd would have to
drive and time out, for layouts that real models do not produce: their sharded dims split at
multiples of 128 (DeepSeek-V3: hidden 7168 = 56 x 128, expert intermediate 2048 over TP <= 16;
attention heads of 128). Unsharded dims need not be multiples of 128 (edge blocks are handled), so
a small test model with, say, hidden 200 works as long as its shards are block-aligned. If a layout
that needs split blocks appears, the all-reduce above is the way to handle it; the refusal tells
the operator which dim to shard differently until then.
"""

from __future__ import annotations

from typing import Iterable

from syncd.layout import Box

BLOCK = (128, 128)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The shape of `weight_scale_inv` for a weight of `shape` (leading dims, e.g. experts, kept)."""
    if len(shape) < 2:
        raise ValueError(f"a blockwise FP8 weight has at least 2 dims, got shape {shape}")
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def require_whole_blocks(
    tensor: str,
    shape: tuple[int, ...],
    source_boxes: Iterable[tuple[str, Box]],
    block: tuple[int, int] = BLOCK,
) -> None:
    """Raise ValueError if any source box (member id, box of canonical tensor `tensor`) cuts a
    block of the last two dims: every box bound there must be a multiple of the block size or the
    dim's end. Leading dims (experts) may be cut anywhere."""
    first = len(shape) - 2
    for member, box in source_boxes:
        for d in (first, first + 1):
            size = block[d - first]
            for cut in (box.start[d], box.stop[d]):
                if cut % size and cut != shape[d]:
                    raise ValueError(
                        f"canonical tensor {tensor}: {member} holds {box}, whose bound {cut} on dim {d} "
                        f"falls inside a {block[0]}x{block[1]} FP8 block; the sender must hold whole blocks "
                        f"to compute their scales, so shard dim {d} at multiples of {size}"
                    )
