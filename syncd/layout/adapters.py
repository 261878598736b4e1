"""Adapter slots in the layout language: a named LoRA adapter's factors as canonical tensors, and
the catalog a generator that takes adapters into slots receives them in.

A sender of adapter `a` registers a catalog of the adapter's factors only, in PEFT's names without
the `base_model.model.` prefix (`model.layers.0.self_attn.q_proj.lora_A.weight [rank, in]`,
`lora_B [out, rank]`), with its `AdapterSpec`. A generator with LoRA on registers its base
catalog as always plus `LoraSlots`; it declares no adapter tensors (adapters come and go after it
started). For a refit of adapter `a`, syncd plans from the senders' catalogs to `slot_catalog(a,
...)` of every such generator: the same canonical tensors whole, in the dtype its slots hold,
each in a local tensor named `slot_tensor(a, canonical)`, which tells the receiver which adapter
the bytes belong to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from syncd.layout.box import Box
from syncd.layout.catalog import CanonicalTensor, Catalog, LocalTensor, Piece

SLOT_PREFIX = "lora/"
# What a request names as its model: a letter or digit first, then letters, digits, '.', '_', '-'.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_FACTOR = re.compile(r"(?P<module>.+)\.(?P<factor>lora_A|lora_B)\.weight")


@dataclass(frozen=True)
class AdapterSpec:
    """A named adapter: what requests ask for (`name`) and what an engine needs besides its
    factors (adapter_config.json's `r`, `lora_alpha`, `target_modules`)."""

    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    def validate(self) -> None:
        """Raise ValueError naming the field that is wrong."""
        if not _NAME.fullmatch(self.name):
            raise ValueError(
                f"adapter name {self.name[:64]!r} is not 1-128 letters, digits, '.', '_' or '-' "
                "starting with a letter or digit (requests name it as their model)"
            )
        if self.rank <= 0:
            raise ValueError(f"adapter {self.name}: rank must be positive, got {self.rank}")
        if not self.target_modules:
            raise ValueError(f"adapter {self.name}: target_modules is empty")


@dataclass(frozen=True)
class LoraSlots:
    """A generator's adapter slots: ranks up to `max_rank`, `max_loras` adapters at once, factors
    held in `dtype`."""

    max_rank: int
    max_loras: int
    dtype: str


def slot_tensor(adapter: str, canonical: str) -> str:
    """The generator-side local tensor of one factor of `adapter`: `lora/<adapter>/<canonical>`."""
    return f"{SLOT_PREFIX}{adapter}/{canonical}"


def parse_slot_tensor(name: str) -> tuple[str, str]:
    """(adapter, canonical) of a `slot_tensor` name; ValueError for any other name."""
    adapter, sep, canonical = name.removeprefix(SLOT_PREFIX).partition("/")
    if not name.startswith(SLOT_PREFIX) or not sep or not canonical:
        raise ValueError(f"{name!r} names no adapter slot tensor ({SLOT_PREFIX}<adapter>/<tensor>)")
    return adapter, canonical


def adapter_rank(catalog: Catalog) -> int:
    """The rank of the adapter a sender's catalog holds (every lora_A is [rank, in], every lora_B
    [out, rank]); ValueError naming a tensor that is no LoRA factor or disagrees on the rank."""
    ranks: dict[int, str] = {}
    for c in catalog.canonical:
        m = _FACTOR.fullmatch(c.name)
        if m is None or len(c.shape) != 2:
            raise ValueError(
                f"{c.name} {list(c.shape)} is no LoRA factor (<module>.lora_A.weight [rank, in] or "
                "<module>.lora_B.weight [out, rank])"
            )
        ranks.setdefault(c.shape[0] if m["factor"] == "lora_A" else c.shape[1], c.name)
    if len(ranks) != 1:
        raise ValueError(f"the adapter's factors disagree on the rank: {sorted(ranks.items())[:4]}")
    return next(iter(ranks))


def slot_catalog(adapter: str, sender: Catalog, dtype: str) -> Catalog:
    """What a generator's slots receive of `adapter`: every canonical tensor of the sender's
    catalog whole, in `dtype` (the sender converts while packing where it holds another)."""
    canonical = tuple(CanonicalTensor(c.name, c.shape, dtype) for c in sender.canonical)
    tensors = tuple(
        LocalTensor(
            slot_tensor(adapter, c.name),
            c.shape,
            dtype,
            (Piece(c.name, Box.full(c.shape), Box.full(c.shape)),),
        )
        for c in canonical
    )
    return Catalog(canonical, tensors)
