"""Per-PP-stage refit: a pipelined trainer (one rank per stage) into one vLLM replica of TP ranks,
one communicator per stage, the stages transferring concurrently or one after the other.

    python bench/stage_bench.py --backend gloo --gib 0.02                 # CPU: 4 processes
    python bench/stage_bench.py --backend nccl --gib 8 --json OUT.json     # 4 GPUs

Ranks 0..pp-1 are the trainer stages (GPUs 0..pp-1), ranks pp..pp+tp-1 the receiver's TP ranks (the
next GPUs; `--devices` maps them otherwise). Each stage's group is {trainer stage s, every receiver
rank}, as syncd negotiates it; a receiver runs one thread per stage, as `MemberAgent` does. Measured
in one run, rounds interleaved: (a) raw, one buffer on one link and on every link at once, (b) the
refit with stages concurrent, (c) the same refit with stages serialized. Every receiver tensor is
compared bit for bit with what the canonical weights say it must hold, and the checksums go through
syncd's own comparison. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from bench.refit_bench import profile_run, spawn_workers, timed_rounds
from syncd.daemon.checks import checksum_mismatch
from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane import (
    GcPause,
    GlooTransport,
    GroupSender,
    LoopCache,
    LoopOptions,
    catalog_views,
    recv_buckets,
    send_buckets,
)
from syncd.plan import DestMember, SourceMember, make_plan
from testkit.synthetic_moe import shape_for, trainer_catalog, vllm_catalog


def _canonical(shape, device) -> dict[str, torch.Tensor]:
    """The model's canonical weights, the same on every rank (seeded per tensor)."""
    out = {}
    for i, c in enumerate(shape.canonical()):
        gen = torch.Generator(device=device).manual_seed(1000 + i)
        out[c.name] = torch.randn(c.shape, generator=gen, device=device, dtype=torch.float32).to(
            torch_dtype(c.dtype)
        )
    return out


def _fill(catalog, views, canonical) -> None:
    """Each local tensor from the canonical weights, piece by piece, as the catalog describes it."""
    for t in catalog.tensors:
        for p in t.pieces:
            region = views[t.name][p.local.slices()]
            region.copy_(canonical[p.canonical][p.canon.slices()].reshape(region.shape))


def _connect(backend: str, stage: int, members: list[int], rank: int, device, timeout_s: float):
    """Stage `stage`'s group: the trainer of the stage creates the address, everyone learns it
    (the default group stands in for syncd's relay), the members join."""
    box, store = [""], None  # the stage's address, broadcast by its trainer
    if rank == stage:
        if backend == "nccl":
            from syncd.member.dataplane.nccl import NcclTransport

            box[0] = NcclTransport.create_address()
        else:
            box[0], store = GlooTransport.create_address("127.0.0.1", len(members), timeout_s)
    dist.broadcast_object_list(box, src=stage)
    if rank not in members:
        return None
    group_rank = members.index(rank)
    if backend == "nccl":
        from syncd.member.dataplane.nccl import NcclTransport

        return NcclTransport.connect(box[0], group_rank, len(members), device, timeout_s)
    return GlooTransport.connect(box[0], group_rank, len(members), f"stage{stage}", timeout_s, store)


def _in_threads(fns) -> None:
    """Run `fns` concurrently; re-raise the first failure."""
    errors: list[BaseException] = []

    def guard(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller after the joins
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def worker(rank: int, args, port: int, out_path: str) -> None:
    pp, tp = args.pp, args.tp
    device = torch.device(f"cuda:{args.devices[rank]}") if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=pp + tp,
        timeout=datetime.timedelta(seconds=600),
    )
    shape = shape_for(args.gib)
    trainers = [SourceMember(f"trainer-{s}", s, trainer_catalog(shape, 1, 0, 1, 0, pp, s)) for s in range(pp)]
    receivers = [DestMember(f"generator-0-{r}", vllm_catalog(shape, tp, r)) for r in range(tp)]
    plan = make_plan(trainers, receivers, bucket_bytes=args.bucket_mib << 20)
    is_trainer = rank < pp
    me = trainers[rank] if is_trainer else receivers[rank - pp]
    catalog = me.catalog
    owned = {t.name: torch.zeros(t.shape, dtype=torch_dtype(t.dtype), device=device) for t in catalog.tensors}
    views = catalog_views(catalog, owned)
    canonical = _canonical(shape, device)
    if is_trainer:
        _fill(catalog, views, canonical)
    else:  # what the receiver must hold after a refit; its own tensors start at zero
        expected = {t.name: torch.empty_like(v) for t, v in zip(catalog.tensors, owned.values())}
        _fill(catalog, catalog_views(catalog, expected), canonical)
    del canonical

    stage_members = {s: [s, *list(range(pp, pp + tp))] for s in range(pp)}
    transports = {s: _connect(args.backend, s, stage_members[s], rank, device, 300) for s in range(pp)}
    transports = {s: t for s, t in transports.items() if t is not None}
    group_ranks = {
        s: {
            (f"trainer-{m}" if m < pp else f"generator-0-{m - pp}"): i for i, m in enumerate(stage_members[s])
        }
        for s in range(pp)
    }
    mine = plan.for_member(me.member_id)
    by_stage = {s: [b for b in mine if b.stage == s] for s in transports}
    checksums: dict[str, str] = {}

    # What a member's agent keeps with each stage's transport and holds while it transfers.
    caches = {s: LoopCache() for s in transports}
    options = LoopOptions(300, args.in_flight, gc_pause=GcPause())

    def refit(concurrent: bool) -> None:
        def stage(s: int):
            run = send_buckets if is_trainer else recv_buckets
            stats = run(by_stage[s], views, transports[s], group_ranks[s], options, cache=caches[s])
            checksums.update(stats.checksums)

        if concurrent or is_trainer:
            _in_threads([lambda s=s: stage(s) for s in by_stage])
        else:
            for s in sorted(by_stage):
                stage(s)

    link_bytes = plan.total_bytes // (pp * tp)
    raw = torch.empty(link_bytes, dtype=torch.uint8, device=device)
    # The raw baseline of the refit: each link (stage s -> receiver r) moves the bytes the plan
    # moves on it, all links at once, no packing and no checksums.
    planned = {
        (s, r): sum(b.nbytes for b in plan.buckets if b.stage == s and b.dst == receivers[r].member_id)
        for s in range(pp)
        for r in range(tp)
    }
    planned_raw = torch.empty(max(planned.values()), dtype=torch.uint8, device=device)

    def post_sends(t, sends) -> None:
        """A trainer posts its sends from one thread, as one group where the transport groups them
        (a communicator takes one thread at a time)."""
        if isinstance(t, GroupSender) and len(sends) > 1:
            handles = list(t.isend_group(sends))
        else:
            handles = [t.isend(buf, peer) for buf, peer in sends]
        for h in handles:
            h.wait(300)

    def raw_links(every_link: bool) -> None:
        """One buffer per link: trainer s -> receiver r over stage s's group (every link at once,
        or only trainer 0 -> receiver 0). A receiver runs a thread per stage, each on its own
        communicator, as `MemberAgent` does."""
        if is_trainer:
            peers = list(range(1, tp + 1)) if every_link else ([1] if rank == 0 else [])
            post_sends(transports[rank], [(raw, p) for p in peers])
        else:
            stages = list(transports) if every_link else ([0] if rank == pp else [])
            _in_threads([lambda s=s: transports[s].irecv(raw, 0).wait(300) for s in stages])

    def raw_planned() -> None:
        if is_trainer:
            post_sends(transports[rank], [(planned_raw[: planned[rank, r]], r + 1) for r in range(tp)])
        else:
            r = rank - pp
            _in_threads(
                [
                    lambda s=s: transports[s].irecv(planned_raw[: planned[s, r]], 0).wait(300)
                    for s in transports
                ]
            )

    methods = {
        "raw_link": lambda: raw_links(False),
        "raw_all_links": lambda: raw_links(True),
        "raw_planned_links": raw_planned,
        "concurrent": lambda: refit(True),
        "serialized": lambda: refit(False),
    }
    times = timed_rounds(methods, device, args.reps)
    if args.profile:  # one more refit, stages concurrent, under the profiler (after a profiled warm-up)
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        for name in ("warmup", "stages"):
            profile_run(lambda: refit(True), device, Path(args.profile) / f"{name}-rank{rank}")

    bit_exact = True if is_trainer else all(torch.equal(owned[n], expected[n]) for n in owned)
    gathered: list[Any] = [None] * (pp + tp)  # (member id, bit exact, checksums) per rank, once gathered
    dist.all_gather_object(gathered, (me.member_id, bit_exact, checksums))
    for t in transports.values():
        t.close()
    if rank == 0:
        sums = {member: s for member, _, s in gathered}
        problem = checksum_mismatch(plan, sums)
        Path(out_path).write_text(
            json.dumps(
                {
                    "times": times,
                    "bytes": plan.total_bytes,
                    "link_bytes": link_bytes,
                    "buckets": len(plan.buckets),
                    "bit_exact": all(ok for _, ok, _ in gathered),
                    "checksums_ok": problem is None,
                    "checksum_problem": problem,
                    "bytes_per_stage": {
                        s: sum(b.nbytes for b in plan.buckets if b.stage == s) for s in range(pp)
                    },
                }
            )
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--gib", type=float, default=0.02, help="model size to move")
    parser.add_argument("--pp", type=int, default=2, help="trainer pipeline stages (one rank each)")
    parser.add_argument("--tp", type=int, default=2, help="receiver TP ranks")
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--in-flight", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument(
        "--devices",
        help="GPU of each rank, comma-separated (default: rank i on GPU i); "
        "trainer stages may share a GPU (their groups differ), e.g. 0,0,1 for pp=2, tp=1",
    )
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--profile", help="also write torch profiler traces and tables of one refit here")
    args = parser.parse_args()
    if args.pp < 1 or args.tp < 1:
        parser.error("--pp and --tp must be at least 1")
    n = args.pp + args.tp
    args.devices = [int(d) for d in args.devices.split(",")] if args.devices else list(range(n))
    if len(args.devices) != n:
        parser.error(f"--devices needs {n} entries (pp + tp), got {len(args.devices)}")
    if len(set(args.devices[args.pp :])) != args.tp or set(args.devices[: args.pp]) & set(
        args.devices[args.pp :]
    ):
        parser.error(
            "each receiver rank needs a GPU of its own, shared with no trainer stage (one NCCL group "
            "cannot hold two ranks on one GPU)"
        )
    if args.backend == "nccl" and torch.cuda.device_count() <= max(args.devices):
        parser.error(
            f"--backend nccl with --devices {args.devices} needs {max(args.devices) + 1} GPUs, "
            f"found {torch.cuda.device_count()}"
        )
    r = spawn_workers(worker, args, args.pp + args.tp)
    med = {name: statistics.median(t) for name, t in r["times"].items()}
    gb = r["bytes"] / 1e9
    summary = {
        "backend": args.backend,
        "pp": args.pp,
        "tp": args.tp,
        "bytes": r["bytes"],
        "bytes_per_stage": r["bytes_per_stage"],
        "concurrent_seconds": round(med["concurrent"], 6),
        "serialized_seconds": round(med["serialized"], 6),
        "raw_gbps": round(r["link_bytes"] / 1e9 / med["raw_link"], 3),
        "raw_all_links_gbps": round(r["link_bytes"] * args.pp * args.tp / 1e9 / med["raw_all_links"], 3),
        "refit_gbps": round(gb / med["concurrent"], 3),
        "serialized_over_concurrent": round(med["serialized"] / med["concurrent"], 3),
        # What concurrent stages can gain at most: all the bytes over the largest stage's.
        "stage_speedup_allowed": round(r["bytes"] / max(r["bytes_per_stage"].values()), 3),
        "stage_speedup_over_allowed": round(
            med["serialized"] / med["concurrent"] / (r["bytes"] / max(r["bytes_per_stage"].values())), 3
        ),
        # Against raw sends of the plan's bytes on every link at once (no packing, no checksums).
        "refit_over_raw_planned_links": round(med["raw_planned_links"] / med["concurrent"], 3),
        "bit_exact": r["bit_exact"],
        "checksums_ok": r["checksums_ok"],
        "bucket_mib": args.bucket_mib,
        "in_flight": args.in_flight,
        "reps": args.reps,
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(0)
        if args.backend == "nccl"
        else f"CPU ({os.cpu_count()} cores)",
        "gpus": args.devices if args.backend == "nccl" else [],
    }
    print(
        f"{args.backend}: pp={args.pp} trainer stages -> tp={args.tp} receiver, "
        f"{gb:.2f} GB in {r['buckets']} buckets, "
        f"bit-exact: {r['bit_exact']}, checksums ok: {r['checksums_ok']}"
        + (f" ({r['checksum_problem']})" if r["checksum_problem"] else "")
    )
    print(
        f"raw: {summary['raw_gbps']:.2f} GB/s on one link, {summary['raw_all_links_gbps']:.2f} GB/s on all "
        f"{args.pp * args.tp} links at once"
    )
    print(
        f"refit, stages concurrent: {med['concurrent']:.4f} s ({summary['refit_gbps']:.2f} GB/s, "
        f"{summary['refit_gbps'] / summary['raw_all_links_gbps']:.2f} x all-links raw)"
    )
    print(
        f"refit, stages serialized: {med['serialized']:.4f} s "
        f"({summary['serialized_over_concurrent']:.2f} x concurrent)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
