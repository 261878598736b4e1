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
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from syncd.layout import hf_names
from syncd.layout.dtypes import lookup
from trainer_svc import comm
from trainer_svc.config import ModelArgs
from trainer_svc.parallel_dims import Mesh
from trainer_svc.state_dict_adapter import (
    COLUMN_PARALLEL,
    CONFIG_FILE,
    ROW_PARALLEL,
    WEIGHTS_FILE,
    canonical_shapes,
    stored_entries,
    stored_tensors,
)

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
        header[name] = {"dtype": lookup(entry_dtype).safetensors, "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as safetensors writes it
    prefix = struct.pack("<Q", len(text)) + text
    starts = {name: len(prefix) + h["data_offsets"][0]
              for name, h in header.items() if name != "__metadata__"}
    return prefix, starts, len(prefix) + offset


def _tp_whole(t: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
    if comm.group_size(group) == 1:
        return t.detach()
    parts = [torch.empty_like(t) for _ in range(comm.group_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim)


def _hf_tensors(name: str, p: torch.Tensor, mesh: Mesh, args: ModelArgs) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors that parameter `name` holds, whole over tp (collective over the tp group)."""
    first_expert = mesh.coords.ep * (args.num_experts // mesh.dims.ep)
    if name.endswith(".experts.gate_up_proj"):
        prefix = name[: -len(".experts.gate_up_proj")]
        E_l, I_l = args.num_experts // mesh.dims.ep, args.moe_intermediate_size // mesh.dims.tp
        pair_E2IH = _tp_whole(p.view(E_l, 2, I_l, -1), mesh.tp, 2)
        out = []
        for proj, k in (("gate_proj", 0), ("up_proj", 1)):
            grouped = hf_names.grouped_expert_name(prefix, proj)
            out += [(hf_names.hf_expert_name(grouped, first_expert + e), pair_E2IH[e, k]) for e in range(E_l)]
        return out
    if name.endswith(".experts.down_proj"):
        grouped = hf_names.grouped_expert_name(name[: -len(".experts.down_proj")], "down_proj")
        whole = _tp_whole(p, mesh.tp, 2)
        return [(hf_names.hf_expert_name(grouped, first_expert + e), whole[e]) for e in range(whole.shape[0])]
    if name.endswith(COLUMN_PARALLEL):
        return [(name, _tp_whole(p, mesh.tp, 0))]
    if name.endswith(ROW_PARALLEL):
        return [(name, _tp_whole(p, mesh.tp, 1))]
    return [(name, p.detach())]


def _writes(name: str, mesh: Mesh) -> tuple[bool, bool]:
    """(takes part in this parameter's tp gather, writes it) for this rank."""
    c = mesh.coords
    is_expert = name.endswith((".experts.gate_up_proj", ".experts.down_proj"))
    part = c.dp == 0 and (is_expert or c.ep == 0)
    return part, part and c.tp == 0


@torch.no_grad()
def export_parallel(weights: Mapping[str, torch.Tensor], mesh: Mesh, args: ModelArgs, out_dir: str | Path,
                    dtype: str = "float32") -> None:
    """Collective over the world: write config.json + model.safetensors (in `dtype`, rounded to
    nearest even where it is narrower than the weights, or FP8_EXPORT) from every writer rank.
    `weights`: this rank's stage parameters by name."""
    out_dir = Path(out_dir)
    path = out_dir / WEIGHTS_FILE
    prefix, starts, size = file_layout(args, dtype)
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
            for hf_name, t in _hf_tensors(name, p, mesh, args):
                if write:
                    for stored_name, stored in stored_tensors(hf_name, t, dtype):
                        _pwrite_all(f.fileno(), stored, starts[stored_name])
    dist.barrier()


def _pwrite_all(fd: int, t: torch.Tensor, offset: int) -> None:
    view = memoryview(t.view(torch.uint8).numpy()).cast("B")  # bytes: numpy has no bfloat16
    while view:  # pwrite may write less than asked (e.g. above 2 GiB on Linux)
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
