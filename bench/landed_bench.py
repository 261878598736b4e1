"""The cost of verifying what landed (`syncd.member.dataplane.landed`), CPU, gloo, real processes.

    python -m bench.landed_bench [--layers 24 --experts 128 --rounds 5 --bucket-mib 1] [--out PATH]

Four trainer ranks send to one receiver (`testkit.four_to_one`), each a process
of its own, as in `make demo` (`--layers 4 --experts 8` is the demo's model). Each round runs a
full refit with the landed check and one without (`LoopOptions.verify_landed`), in alternating
order, in the same processes on the same transport; the wire checksums run in both. Reports the
receiver's median wall time of each, their ratio, and the check alone on the receiver's tensors
(the unpack fused with the check, as the loop runs it, minus the plain unpack of the same
buckets, timed after the refits). No vLLM: the in-place
install checksums each layer as it closes, the same pass over the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from syncd.member.dataplane import (
    GcPause,
    LoopCache,
    LoopOptions,
    recv_buckets,
    send_buckets,
)
from syncd.member.dataplane.checksum import Checksums
from syncd.member.dataplane.prepared import PreparedLoop
from syncd.vocabulary import Direction
from testkit.four_to_one import RECEIVER, SENDERS, add_model_args, join_rank, moe_plan, run_members

ON, OFF = "landed check on", "landed check off"
CHECK_ALONE = "the landed check alone"


def _member(rank: int, args: argparse.Namespace, address: str, results) -> None:
    r = join_rank(rank, args, address, "landed-bench")
    me, sending, ranks, views, transport = r.me, r.sending, r.ranks, r.views, r.transport
    mine = r.plan.for_member(me)
    cache, pause = LoopCache(), GcPause()
    rows = []

    barrier = r.barrier

    def refit(method: str) -> None:
        options = LoopOptions(120, gc_pause=pause, verify_landed=method == ON)
        barrier()
        t0 = time.perf_counter()
        run = send_buckets if sending else recv_buckets
        stats = run(mine, views, transport, ranks, options, cache=cache)
        rows.append({"method": method, "seconds": time.perf_counter() - t0, "bytes": stats.bytes})

    for round_ in range(args.rounds + 1):
        for method in (ON, OFF) if round_ % 2 else (OFF, ON):
            refit(method)
    if not sending:  # the check alone, as the loop runs it: the unpack with it minus the unpack
        flat = torch.empty(max(b.nbytes for b in mine), dtype=torch.uint8)
        prepared = PreparedLoop(Direction.RECV).buckets(mine, views, [flat[: b.nbytes] for b in mine])
        for round_ in range(args.rounds + 1):
            t0 = time.perf_counter()
            sums = Checksums()
            for bucket in prepared:
                bucket.copy_and_checksum(sums)
            t1 = time.perf_counter()
            for bucket in prepared:
                bucket.copy()
            t2 = time.perf_counter()
            if round_:  # the first prepares
                rows.append({"method": CHECK_ALONE, "seconds": max(0.0, (t1 - t0) - (t2 - t1)), "bytes": 0})
    results[me] = rows[2:]  # the first round warms up
    transport.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    _, _, plan = moe_plan(args)
    results = run_members(_member, args)
    seconds = {
        m: statistics.median(r["seconds"] for r in results[RECEIVER] if r["method"] == m)
        for m in (ON, OFF, CHECK_ALONE)
    }
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "plan_bytes": plan.total_bytes,
        "buckets": len(plan.buckets),
        "layers": args.layers,
        "experts": args.experts,
        "rounds": args.rounds,
        "bucket_mib": args.bucket_mib,
        "load": os.getloadavg(),
        "receiver_seconds": seconds,
        "ratio_on_over_off": seconds[ON] / seconds[OFF],
        "rows": results[RECEIVER],
    }
    print(
        f"{plan.total_bytes / 1e6:.1f} MB, {len(plan.buckets)} buckets, "
        f"{SENDERS} senders -> 1 receiver (gloo, CPU)"
    )
    for m in (ON, OFF, CHECK_ALONE):
        print(f"{m:<24} {seconds[m] * 1e3:8.2f} ms (median of {args.rounds})")
    print(f"ratio on / off: {report['ratio_on_over_off']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
