"""Sharded checkpoint loading: each rank reads from the safetensors only the boxes its catalog holds.

The rank's syncd catalog (`catalog.build_catalog`) already says, for every local parameter, which
box of which canonical tensor lands where; loading executes it against the files. A grouped
expert box `[e0:e1, ...]` reads experts e0..e1-1 from their per-expert HF tensors, so an ep rank
never touches the other ranks' experts. A rank's host memory while loading is then its parameters
plus one box in flight, not the model.

safetensors memory-maps the file, and pages a read touches count towards the process's resident
memory while the file is open; every canonical tensor therefore opens its files anew, so at most
one tensor's touched pages are resident at a time. (A box that cuts columns, e.g. a tp shard of
o_proj, touches the pages of every row of that tensor.)
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from syncd.layout import Box, Catalog, Piece, hf_names


def checkpoint_index(model_dir: str | Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """HF tensor name -> (file, shape) over every *.safetensors of `model_dir` (headers only)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {model_dir}")
    index = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                index[name] = (path, tuple(f.get_slice(name).get_shape()))
    return index


def _check_shapes(catalog: Catalog, index: Mapping[str, tuple[Path, tuple[int, ...]]], model_dir) -> None:
    found = hf_names.canonical_shapes_from_hf({name: shape for name, (_, shape) in index.items()})
    for canon in catalog.canonical:
        if canon.name not in found:
            raise ValueError(f"{model_dir}: tensor {canon.name} missing from the checkpoint")
        if tuple(found[canon.name]) != tuple(canon.shape):
            raise ValueError(
                f"{model_dir}: {canon.name} has shape {tuple(found[canon.name])}, "
                f"expected {tuple(canon.shape)}"
            )


@torch.no_grad()
def read_shards(model_dir: str | Path, catalog: Catalog, views: Mapping[str, torch.Tensor]) -> int:
    """Fill every local tensor (`views`: catalog name -> tensor in the catalog's shape) with its
    boxes from the checkpoint; returns the bytes read. Raises ValueError naming a tensor that is
    missing or of another shape than the catalog declares."""
    index = checkpoint_index(model_dir)
    _check_shapes(catalog, index, model_dir)
    by_canonical: dict[str, list[tuple[str, Piece]]] = {}
    for t in catalog.tensors:
        for piece in t.pieces:
            by_canonical.setdefault(piece.canonical, []).append((t.name, piece))
    read = 0
    for name, pieces in by_canonical.items():
        with ExitStack() as files:  # closed after each canonical tensor: its mapped pages go with it
            opened: dict[Path, object] = {}

            def handle(hf_name: str, opened: dict[Path, object] = opened, files: ExitStack = files):
                path = index[hf_name][0]
                if path not in opened:
                    opened[path] = files.enter_context(safe_open(str(path), framework="pt"))
                return opened[path]

            for local_name, piece in pieces:
                # the destination region in the canonical box's shape; .view so a layout that
                # would need a copy fails loudly instead of filling a temporary
                target = views[local_name][piece.local.slices()].view(piece.canon.shape)
                read += _read_box(name, piece.canon, target, handle)
    return read


def _read_box(name: str, box: Box, target: torch.Tensor, handle) -> int:
    """Copy canonical `name`[box] into `target`; grouped experts one expert at a time, so only one
    expert's slice is in flight. Returns the bytes read."""
    if not hf_names.is_grouped_expert(name):
        target.copy_(handle(name).get_slice(name)[box.slices()])
        return target.numel() * target.element_size()
    for e in range(box.start[0], box.stop[0]):
        hf_name = hf_names.hf_expert_name(name, e)
        target[e - box.start[0]].copy_(handle(hf_name).get_slice(hf_name)[box.slices()[1:]])
    return target.numel() * target.element_size()
