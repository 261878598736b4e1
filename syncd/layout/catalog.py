"""Catalogs: what one member holds, as boxes of canonical (Hugging Face) tensors.

A member (trainer rank or generator worker) registers a `Catalog`: its local tensors, each one a
set of `Piece`s. A piece says "the region `canon` of canonical tensor `canonical` lives at region
`local` of this local tensor". The two regions have the same extents once size-1 dims are dropped,
so a piece can place a box of a 3-D canonical tensor inside a 2-D (fused) local tensor.

Catalogs are immutable and content-hashed: identical layouts (data-parallel replicas, generator
replicas) register one catalog, and a member whose catalog syncd already holds sends only the hash.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property

from syncd.layout.box import Box, non_unit_dims
from syncd.layout.dtypes import dtype_bytes


@dataclass(frozen=True, slots=True)
class CanonicalTensor:
    """One tensor of the HF checkpoint (experts grouped, see `syncd.layout.hf_names`)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        size = dtype_bytes(self.dtype)
        for n in self.shape:
            size *= n
        return size


@dataclass(frozen=True)
class Piece:
    """Region `canon` of canonical tensor `canonical`, stored at region `local` of a local tensor."""

    canonical: str
    canon: Box
    local: Box

    def __post_init__(self) -> None:
        a = [self.canon.shape[d] for d in non_unit_dims(self.canon.shape)]
        b = [self.local.shape[d] for d in non_unit_dims(self.local.shape)]
        if a != b:
            raise ValueError(
                f"piece of {self.canonical}: canonical box {self.canon} and local box {self.local} "
                "must have the same extents once size-1 dims are dropped"
            )

    @cached_property
    def _dim_map(self) -> tuple[tuple[int, int], ...]:
        """Pairs (canonical dim, local dim) of the non-unit dims, matched in order."""
        return tuple(zip(non_unit_dims(self.canon.shape), non_unit_dims(self.local.shape)))

    def local_region(self, sub: Box) -> Box:
        """The local box holding `sub`, a sub-box of `self.canon`."""
        start, stop = list(self.local.start), list(self.local.stop)
        for cd, ld in self._dim_map:
            start[ld] = self.local.start[ld] + sub.start[cd] - self.canon.start[cd]
            stop[ld] = start[ld] + sub.stop[cd] - sub.start[cd]
        return Box(tuple(start), tuple(stop))


@dataclass(frozen=True)
class LocalTensor:
    """A tensor of one member. `shape` is the shape boxes are expressed in: the member's data
    plane views its (contiguous) tensor as `shape` before reading or writing boxes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        size = dtype_bytes(self.dtype)
        for n in self.shape:
            size *= n
        return size


@dataclass(frozen=True)
class Catalog:
    """Everything one member holds. Validate with `validate()` before trusting foreign input.

    `partial` (trainers only): the member sends only the canonical tensors it declares, and a
    destination keeps every tensor that no source declares as it serves it (a LoRA trainer's merged
    target modules over a frozen base). The planner plans those tensors only when every source
    is partial; otherwise a tensor no source holds is an error, as always."""

    canonical: tuple[CanonicalTensor, ...]
    tensors: tuple[LocalTensor, ...]
    partial: bool = False

    @cached_property
    def canonical_by_name(self) -> dict[str, CanonicalTensor]:
        return {c.name: c for c in self.canonical}

    @cached_property
    def content_hash(self) -> str:
        return "sha256:" + hashlib.sha256(_canonical_json(self).encode()).hexdigest()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def validate(self, *, require_full_cover: bool = True) -> None:
        """Raise ValueError naming the tensor for: unknown dtypes, duplicate names, boxes outside
        their tensors, dtype disagreement between a piece and its canonical tensor, overlapping
        local boxes, and (by default) local elements that no piece covers."""
        seen: set[str] = set()
        for c in self.canonical:
            dtype_bytes(c.dtype)
            if c.name in seen:
                raise ValueError(f"canonical tensor {c.name} listed twice")
            if not c.shape or any(n <= 0 for n in c.shape):
                raise ValueError(f"canonical tensor {c.name} has invalid shape {c.shape}")
            seen.add(c.name)
        names: set[str] = set()
        for t in self.tensors:
            if t.name in names:
                raise ValueError(f"local tensor {t.name} listed twice")
            names.add(t.name)
            _validate_local(t, self.canonical_by_name, require_full_cover)


def _validate_local(t: LocalTensor, canon: dict[str, CanonicalTensor], full_cover: bool) -> None:
    dtype_bytes(t.dtype)
    if not t.shape or any(n <= 0 for n in t.shape):
        raise ValueError(f"local tensor {t.name} has invalid shape {t.shape}")
    covered = 0
    for p in t.pieces:
        c = canon.get(p.canonical)
        if c is None:
            raise ValueError(f"local tensor {t.name}: canonical tensor {p.canonical} is not declared")
        if c.dtype != t.dtype:
            raise ValueError(f"local tensor {t.name} is {t.dtype} but its canonical {c.name} is {c.dtype}")
        if not p.canon.within(c.shape):
            raise ValueError(f"box {p.canon} is outside canonical tensor {c.name} of shape {c.shape}")
        if not p.local.within(t.shape):
            raise ValueError(f"box {p.local} is outside local tensor {t.name} of shape {t.shape}")
        covered += p.local.numel
    overlap = first_overlap([p.local for p in t.pieces])
    if overlap is not None:
        a, b = overlap
        raise ValueError(f"local tensor {t.name}: boxes {a} and {b} overlap")
    numel = Box.full(t.shape).numel
    if full_cover and covered != numel:
        raise ValueError(
            f"local tensor {t.name}: pieces cover {covered} of its {numel} elements; "
            "every element must come from a canonical tensor"
        )


def owning_layer(tensor_name: str) -> str:
    """The layer (module path) that holds a local tensor: its name without the last component
    ("model.layers.3.mlp.experts.w13_weight" -> "model.layers.3.mlp.experts"). A generator that
    installs while it receives post-processes one such layer once all of it arrived."""
    return tensor_name.rpartition(".")[0]


def first_overlap(boxes: list[Box]) -> tuple[Box, Box] | None:
    """A pair of overlapping boxes, or None. Sweep over dim 0 so that grids of many boxes stay
    near O(n log n)."""
    order = sorted(boxes, key=lambda b: b.start)
    active: list[Box] = []
    for box in order:
        active = [a for a in active if a.stop[0] > box.start[0]]
        for a in active:
            if a.intersect(box) is not None:
                return a, box
        active.append(box)
    return None


def _canonical_json(catalog: Catalog) -> str:
    doc: dict[str, object] = {
        "canonical": sorted([c.name, list(c.shape), c.dtype] for c in catalog.canonical),
        "tensors": [
            [
                t.name,
                list(t.shape),
                t.dtype,
                [[p.canonical, p.canon.start, p.canon.stop, p.local.start, p.local.stop] for p in t.pieces],
            ]
            for t in catalog.tensors
        ],
    }
    if catalog.partial:  # absent otherwise: every full catalog keeps the hash it always had
        doc["partial"] = True
    return json.dumps(doc, separators=(",", ":"))
