"""What a colocated refit on one GPU could reach with today's kernels: the receiver copies every
unit straight from the sender's tensors through CUDA IPC (no staging, no pack), the sender
checksums its regions and the receiver checksums where they landed, against a device-to-device
copy of the same bytes. A probe for issue 32's GPU half, not the product's path.

    python -m bench.colocated_gpu_probe [--gib 4] [--reps 5] [--json PATH]

Two processes on GPU 0: the sender (the synthetic Qwen3-MoE-like model of `refit_bench.py`, one
expert-TP trainer rank holding everything) shares each tensor with `torch.multiprocessing`'s
CUDA IPC reduction; the receiver (vLLM's layout, TP 1) opens them once. Per round, timed in the
receiver from a common start: the sender's checksums of its units' regions, then the receiver's
per-unit copies (`copy_`, strided where the layouts differ) and its landed check; also the copies
alone and the copies plus only the landed check. Medians of `--reps` rounds after a warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from bench.landed_gpu_bench import gpu_timed
from bench.refit_bench import shape_for
from bench.synthetic_moe import trainer_catalog, vllm_catalog
from syncd.commands import checksum_key
from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane import catalog_views
from syncd.member.dataplane.checksum import Checksums
from syncd.member.dataplane.landed import landed_checksums
from syncd.net import free_port
from syncd.plan import DestMember, SourceMember, make_plan

_WAIT = datetime.timedelta(seconds=120)


def _source_checksums(units, views) -> dict[str, str]:
    """The sender's checksums of its units' regions, where they lie (keyed as a refit's)."""
    sums = Checksums()
    for u in units:
        sums.add_region(checksum_key(u.canonical, u.canon), views[u.src_tensor][u.src_box.slices()])
    sums.flush()
    return sums.result()


def member(rank: int, port: int, args: argparse.Namespace) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=_WAIT)
    shape = shape_for(args.gib)
    src_cat, dst_cat = trainer_catalog(shape, 1, 0, 1, 0), vllm_catalog(shape, 1, 0)
    plan = make_plan(
        [SourceMember("trainer", 0, src_cat)], [DestMember("generator", dst_cat)], bucket_bytes=512 << 20
    )
    units = [u for b in plan.buckets for u in b.units]
    if rank == 0:
        gen = torch.Generator(device="cuda").manual_seed(0)
        own = {
            t.name: torch.randn(t.shape, generator=gen, device="cuda").to(torch_dtype(t.dtype))
            for t in src_cat.tensors
        }
        store.set("handles", pickle.dumps({k: reduce_tensor(v)[1] for k, v in own.items()}).hex())
        views = catalog_views(src_cat, own)
        for r in range(args.reps + 2):
            store.wait([f"start/{r}"], _WAIT)
            sums = _source_checksums(units, views)
            store.set(f"ready/{r}", json.dumps(sums))
            store.wait([f"done/{r}"], _WAIT)
        return
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    handles = pickle.loads(bytes.fromhex(store.get("handles").decode()))
    theirs = catalog_views(src_cat, {k: rebuild_cuda_tensor(*v) for k, v in handles.items()})
    mine = catalog_views(
        dst_cat,
        {
            t.name: torch.full(t.shape, float("nan"), dtype=torch_dtype(t.dtype), device="cuda")
            for t in dst_cat.tensors
        },
    )
    pairs = []  # (destination region, source region in the destination's shape: same C order)
    for u in units:
        d = mine[u.dst_tensor][u.dst_box.slices()]
        pairs.append((d, theirs[u.src_tensor][u.src_box.slices()].view(d.shape)))
    nbytes = sum(d.numel() * d.element_size() for d, _ in pairs)

    def copies() -> None:
        for d, s in pairs:
            d.copy_(s)

    flat_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_b = torch.empty_like(flat_a)
    d2d_s = gpu_timed(lambda: flat_b.copy_(flat_a), args.reps)
    copies_s = gpu_timed(copies, args.reps)

    def copies_and_landed_check() -> None:
        copies()
        landed_checksums(units, mine)

    copies_landed_s = gpu_timed(copies_and_landed_check, args.reps)
    refits, agree, exact = [], True, False
    for r in range(args.reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        store.set(f"start/{r}", "1")
        store.wait([f"ready/{r}"], _WAIT)
        copies()
        landed = landed_checksums(units, mine)  # reads back: the copies are done
        seconds = time.perf_counter() - t0
        agree = agree and landed == json.loads(store.get(f"ready/{r}"))
        if r == args.reps + 1:  # before the sender may leave: its memory is read here
            exact = all(torch.equal(d.view(torch.uint8), s.view(torch.uint8)) for d, s in pairs)
        store.set(f"done/{r}", "1")
        if r >= 2:
            refits.append(seconds)
    refit_s = statistics.median(refits)
    gbps = lambda s: round(nbytes / s / 1e9, 1)  # noqa: E731 - a local shorthand
    result = {
        "device": torch.cuda.get_device_name(),
        "bytes": nbytes,
        "units": len(units),
        "d2d_gbps": gbps(d2d_s),
        "refit_gbps": gbps(refit_s),
        "refit_over_d2d": round(d2d_s / refit_s, 3),
        "copies_only_gbps": gbps(copies_s),
        "copies_and_landed_check_gbps": gbps(copies_landed_s),
        "checksums": agree,
        "bit_exact": exact,
        "reps": args.reps,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        member(args.rank, args.port, args)
        return
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False)  # noqa: F841
    base = [sys.executable, __file__, "--gib", str(args.gib), "--reps", str(args.reps), "--port", str(port)]
    base += ["--json", args.json] if args.json else []
    procs = [subprocess.Popen([*base, "--rank", str(r)], env=dict(os.environ)) for r in (0, 1)]
    while all(p.poll() is None for p in procs):  # one failing ends the other
        time.sleep(0.5)
    if any(p.poll() for p in procs):
        for p in procs:
            p.kill()
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"member processes exited with {codes}")


if __name__ == "__main__":
    main()
