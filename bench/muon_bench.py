"""Muon optimizer-step benchmark: the planned communication paths against naive Muon.

    python bench/muon_bench.py [--inter 256 --hidden 512 --rounds 5 --json OUT]

For each scenario, G = tp x replicas processes (gloo on CPU, NCCL with --device cuda) hold their
pieces of M expert matrices [I, H] cut over tp along I, as the trainer's expert-TP layout does
(replicas hold identical pieces, like dp copies of experts). Two ways to compute every rank's
pieces of the M orthogonalized updates are timed in interleaved rounds:
  planned: `trainer_svc.optim.muon_comm.orthogonalized_pieces` on the path `muon_plan` picks
  naive:   per matrix, all-gather its tp pieces, orthogonalize the whole matrix on every rank,
           keep one's piece (what a per-parameter Muon on sharded weights does)
and the peak memory each adds (peak RSS above the level before the call, glibc told to return
large blocks at once; on GPUs, peak allocated). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from bench.refit_bench import spawn_workers, timed_rounds
from trainer_svc.optim.muon import muon_update
from trainer_svc.optim.muon_comm import orthogonalized_pieces
from trainer_svc.optim.muon_plan import BatchLayout, choose_path

NS_STEPS = 5
# (matrices M, tp, replicas): one scenario per path that communicates
SCENARIOS = ((8, 4, 1), (8, 2, 2), (2, 4, 1), (6, 4, 1))


def _peak_extra_mib(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    base = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - base) / 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise ValueError(f"/proc/self/status has no {field}")


def _naive(pieces, layout: BatchLayout, t: int, tp_group) -> list[torch.Tensor]:
    out = []
    for piece in pieces:
        parts = [torch.empty_like(piece) for _ in range(layout.tp)]
        dist.all_gather(parts, piece.contiguous(), group=tp_group)
        whole = muon_update(torch.cat(parts, dim=layout.shard_dim), NS_STEPS)
        out.append(whole.chunk(layout.tp, dim=layout.shard_dim)[t].contiguous())
    return out


def worker(rank: int, args, port: int, out_path: str) -> None:
    matrices, tp, replicas = args.scenario
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=tp * replicas,
    )
    tp_groups = [dist.new_group(list(range(r * tp, (r + 1) * tp))) for r in range(replicas)]
    tp_group = tp_groups[rank // tp]
    layout = BatchLayout(((args.inter, args.hidden),) * matrices, 0, tp, replicas)
    path = choose_path(layout)
    gen = torch.Generator().manual_seed(rank % tp)  # replicas hold the same pieces
    pieces = [torch.randn(layout.piece_shape(m), generator=gen).to(device) for m in range(matrices)]
    methods = {
        "planned": lambda: orthogonalized_pieces(
            pieces, layout, path, rank, dist.group.WORLD, tp_group, NS_STEPS
        ),
        "naive": lambda: _naive(pieces, layout, rank % tp, tp_group),
    }
    for a, b in zip(methods["planned"](), methods["naive"]()):  # the same result, or the timing is moot
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    memory = {name: _peak_extra_mib(fn, device) for name, fn in methods.items()}
    times = timed_rounds(methods, device, args.rounds)
    mem_all: list[Any] = [None] * dist.get_world_size()  # each rank's `memory`, once gathered
    dist.all_gather_object(mem_all, memory)
    if rank == 0:
        row = {
            "matrices": matrices,
            "tp": tp,
            "replicas": replicas,
            "path": path,
            "matrix": [args.inter, args.hidden],
        }
        for name in methods:
            row[f"{name}_ms"] = 1e3 * statistics.median(times[name])
            row[f"{name}_ms_min_max"] = [1e3 * min(times[name]), 1e3 * max(times[name])]
            row[f"{name}_peak_extra_mib_max_rank"] = max(m[name] for m in mem_all)
        Path(out_path).write_text(json.dumps(row))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inter", type=int, default=256, help="expert intermediate size I (rows, cut over tp)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size H (columns)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # workers return freed blocks: honest peaks
    rows = []
    for scenario in SCENARIOS:
        args.scenario = scenario
        row = spawn_workers(worker, args, scenario[1] * scenario[2])
        rows.append(row)
        print(
            f"M {row['matrices']:2d} tp {row['tp']} replicas {row['replicas']} {row['path']:10s} "
            f"planned {row['planned_ms']:8.1f} ms {row['planned_peak_extra_mib_max_rank']:6.1f} MiB | "
            f"naive {row['naive_ms']:8.1f} ms {row['naive_peak_extra_mib_max_rank']:6.1f} MiB",
            flush=True,
        )
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "device": args.device,
        "rounds": args.rounds,
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
