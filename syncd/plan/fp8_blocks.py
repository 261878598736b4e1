"""FP8 blockwise weights as the planner sees them: the block grid, and which source layouts it
accepts.

A blockwise-FP8 generator (DeepSeek-V3 / Qwen3-FP8 checkpoints: `quantization_config` fp8 with
`weight_block_size [128, 128]`) holds each quantized weight as e4m3 values plus a float32
`weight_scale_inv` with one entry per 128x128 block of the weight's last two dims (grouped expert
tensors `[E, N, K]` have one grid per expert). Blocks at the end of a dim that is not a multiple of
128 are smaller; they still get one scale each. `syncd.member.dataplane.fp8.quantize_blockwise` is the
reference quantizer.

Which tensors are FP8 (`is_quantized`): the projection weights of attention and MLP, dense and
experts, as in those checkpoints; embeddings, the LM head, norms and the MoE router stay in the
model's dtype. A weight's scales are the canonical tensor `<weight>_scale_inv` (`scale_name`).
A destination declares both (`blockwise_fp8_catalog`); the planner gives it units that the sender
computes with the quantizer from its own (bf16 or fp32) weight, so the wire carries e4m3 values and
float32 scales, never the wider weights.

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

import re
from collections.abc import Iterable
from dataclasses import replace

from syncd.layout import Box, CanonicalTensor, Catalog, LocalTensor, Piece

BLOCK = (128, 128)
FP8_DTYPE = "float8_e4m3fn"
SCALE_DTYPE = "float32"
SCALE_SUFFIX = "_scale_inv"
QUANTIZABLE_SOURCES = frozenset({"float32", "bfloat16", "float16"})
_PROJECTION_WEIGHT = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def is_quantized(canonical: str) -> bool:
    """Whether a blockwise-FP8 checkpoint holds canonical tensor `canonical` in FP8."""
    return _PROJECTION_WEIGHT.search(canonical) is not None


def quantizes(name: str, src_dtype: str, dst_dtype: str) -> bool:
    """Whether a destination holding canonical tensor `name` in `dst_dtype`, from senders holding
    it in `src_dtype`, gets it from the sender's block quantizer (instead of a cast)."""
    return dst_dtype == FP8_DTYPE and src_dtype in QUANTIZABLE_SOURCES and is_quantized(name)


def scale_name(weight: str) -> str:
    """The canonical (or local) name of the block scales of `weight`."""
    return weight + SCALE_SUFFIX


def scaled_weight(name: str) -> str | None:
    """The FP8 weight whose scales `name` names, or None when `name` is not a scale tensor."""
    weight = name.removesuffix(SCALE_SUFFIX)
    return weight if weight != name and is_quantized(weight) else None


def to_grid(box: Box, block: tuple[int, int] = BLOCK) -> Box:
    """The blocks that `box` of a weight touches, as a box of its scale tensor."""
    start = (*box.start[:-2], box.start[-2] // block[0], box.start[-1] // block[1])
    stop = (*box.stop[:-2], -(-box.stop[-2] // block[0]), -(-box.stop[-1] // block[1]))
    return Box(start, stop)


def from_grid(box: Box, shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> Box:
    """The elements of a weight of `shape` that the blocks `box` (of its scale tensor) cover."""
    start = (*box.start[:-2], box.start[-2] * block[0], box.start[-1] * block[1])
    stop = (*box.stop[:-2], min(box.stop[-2] * block[0], shape[-2]), min(box.stop[-1] * block[1], shape[-1]))
    return Box(start, stop)


def whole_blocks(box: Box, shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> Box:
    """`box` of a weight of `shape` grown to the whole blocks it touches."""
    return from_grid(to_grid(box, block), shape, block)


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
                        f"falls inside a {block[0]}x{block[1]} FP8 block; one scale covers a whole block, so "
                        f"every holder must hold whole blocks: shard dim {d} at multiples of {size}"
                    )


def blockwise_fp8_catalog(catalog: Catalog, block: tuple[int, int] = BLOCK) -> Catalog:
    """`catalog` as a blockwise-FP8 member holds it: every local tensor whose pieces are all
    quantized canonical tensors (`is_quantized`) becomes FP8 and is followed by its scales
    (`<name>_scale_inv`, float32), whose pieces are the weight's pieces on the block grid; their
    canonical tensors are declared likewise. Raises ValueError naming the tensor when a piece's
    bound (in the canonical tensor or in the local one) falls inside a block, since one scale would
    then cover elements of two pieces: vLLM refuses such shards too."""
    canonical: list[CanonicalTensor] = []
    for c in catalog.canonical:
        if is_quantized(c.name):
            canonical += [
                replace(c, dtype=FP8_DTYPE),
                CanonicalTensor(scale_name(c.name), scale_shape(c.shape, block), SCALE_DTYPE),
            ]
        else:
            canonical.append(c)
    shapes = {c.name: c.shape for c in catalog.canonical}
    tensors: list[LocalTensor] = []
    for t in catalog.tensors:
        if not t.pieces or not all(is_quantized(p.canonical) for p in t.pieces):
            tensors.append(t)
            continue
        for p in t.pieces:
            require_whole_blocks(
                p.canonical, shapes[p.canonical], [(f"local tensor {t.name}", p.canon)], block
            )
            require_whole_blocks(t.name, t.shape, [("its layout", p.local)], block)
        scales = tuple(
            Piece(scale_name(p.canonical), to_grid(p.canon, block), to_grid(p.local, block)) for p in t.pieces
        )
        tensors += [
            replace(t, dtype=FP8_DTYPE),
            LocalTensor(scale_name(t.name), scale_shape(t.shape, block), SCALE_DTYPE, scales),
        ]
    out = Catalog(tuple(canonical), tuple(tensors))
    out.validate()
    return out
