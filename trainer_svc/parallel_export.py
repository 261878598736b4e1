"""Export without gathering the model on one rank: every writer rank writes its own tensors into
one shared safetensors file at offsets all ranks compute alike.

The file's layout (header, then every stored tensor in name order: each HF tensor in the export
dtype, or under `--export-dtype fp8` the quantized ones with their block scales) depends only on
the model args and that dtype, so rank 0 writes the header and sizes the file while nobody waits
for data; then, per stage, the rank (dp 0, ep 0, tp 0) writes the stage's non-expert tensors and
every rank (dp 0, ep e, tp 0) its whole experts, after an all-gather over its tp group, one
parameter at a time; so a writer quantizes whole HF tensors whatever the tp cut (a block's scale
needs the whole block). No rank holds more than one parameter gathered over tp besides its own
shards. All ranks must see the same file, which `trainer.py` checks (one host) before choosing
this over `gather_canonical`.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from syncd.layout import hf_names
from syncd.layout.dtypes import lookup
from trainer_svc.canonical import canonical_shapes
from trainer_svc.config import ModelArgs
from trainer_svc.export_dtype import stored_entries, stored_tensors
from trainer_svc.hf_checkpoint import CONFIG_FILE, WEIGHTS_FILE
from trainer_svc.parallel_dims import Mesh
from trainer_svc.shard_gather import tp_whole
from trainer_svc.sharding import sharding_of


def file_layout(args: ModelArgs, dtype: str = "float32") -> tuple[bytes, dict[str, int], int]:
    """(header bytes, absolute file offset of every stored tensor, file size) of the safetensors
    file of an export in `dtype` (a dtype name, or FP8_EXPORT: see `stored_entries`)."""
    hf_shapes = []
    for name, shape in canonical_shapes(args).items():
        if hf_names.is_grouped_expert(name):
            hf_shapes += [(hf_names.hf_expert_name(name, e), shape[1:]) for e in range(shape[0])]
        else:
            hf_shapes.append((name, shape))
    entries = [entry for name, shape in hf_shapes for entry in stored_entries(name, shape, dtype)]
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, entry_dtype, shape in sorted(entries):
        size = math.prod(shape) * lookup(entry_dtype).itemsize
        header[name] = {
            "dtype": lookup(entry_dtype).safetensors,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as safetensors writes it
    prefix = struct.pack("<Q", len(text)) + text
    starts = {
        name: len(prefix) + h["data_offsets"][0] for name, h in header.items() if name != "__metadata__"
    }
    return prefix, starts, len(prefix) + offset


def _hf_tensors(
    name: str, p: torch.Tensor, mesh: Mesh, args: ModelArgs, shapes: Mapping[str, tuple[int, ...]]
) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors that parameter `name` holds, whole over tp (collective over the tp group)."""
    first_expert = mesh.coords.ep * (args.num_experts // mesh.dims.ep)
    out = []
    for source, t in tp_whole(name, p, shapes, mesh):
        if hf_names.is_grouped_expert(source):
            out += [(hf_names.hf_expert_name(source, first_expert + e), t[e]) for e in range(t.shape[0])]
        else:
            out.append((source, t))
    return out


def _writes(name: str, mesh: Mesh) -> tuple[bool, bool]:
    """(takes part in this parameter's tp gather, writes it) for this rank."""
    c = mesh.coords
    ep_sharded = sharding_of(name).ep_dim is not None  # each ep rank writes its own experts
    part = c.dp == 0 and (ep_sharded or c.ep == 0)
    return part, part and c.tp == 0


@torch.no_grad()
def export_parallel(
    weights: Mapping[str, torch.Tensor],
    mesh: Mesh,
    args: ModelArgs,
    out_dir: str | Path,
    dtype: str = "float32",
) -> None:
    """Collective over the world: write config.json + model.safetensors (in `dtype`, rounded to
    nearest even where it is narrower than the weights, or FP8_EXPORT) from every writer rank.
    `weights`: this rank's stage parameters by name."""
    out_dir = Path(out_dir)
    path = out_dir / WEIGHTS_FILE
    prefix, starts, size = file_layout(args, dtype)
    shapes = canonical_shapes(args)
    if mesh.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(prefix)
            f.truncate(size)
        (out_dir / CONFIG_FILE).write_text(json.dumps(args.to_hf(dtype), indent=2) + "\n")
    dist.barrier()
    with open(path, "r+b") as f:
        for name, p in weights.items():
            part, write = _writes(name, mesh)
            if not part:
                continue
            for hf_name, t in _hf_tensors(name, p, mesh, args, shapes):
                if write:
                    for stored_name, stored in stored_tensors(hf_name, t, dtype):
                        _pwrite_all(f.fileno(), stored, starts[stored_name])
    dist.barrier()


def _pwrite_all(fd: int, t: torch.Tensor, offset: int) -> None:
    view = t.view(torch.uint8).numpy().data.cast("B")  # bytes: numpy has no bfloat16
    while view:  # pwrite may write less than asked (e.g. above 2 GiB on Linux)
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
