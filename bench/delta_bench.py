"""Delta links against full refits on the data plane alone, CPU, gloo, real processes.

    python -m bench.delta_bench [--layers 24 --experts 128 --rounds 3 --bucket-mib 1] [--out PATH]

Four trainer ranks send to one receiver (`testkit.four_to_one`), each a process of its own, as in
`make demo`. Per round, one after another: a full refit (`send_buckets` / `recv_buckets`, what syncd
runs without delta refits) of the weights the last transfer moved, a full refit after a step that
changes everything, a delta refit after an RL-like step (a fraction `--changed` of the elements move
by one bf16 step), and a delta refit after a step that changes everything (every bucket goes dense);
plus raw gloo: the same bytes as one buffer per sender. A step (untimed: the senders change their
tensors while the receiver waits at the barrier) most likely leaves the caches cold, as a trainer's
step does: the receiver's CPU for the same transfer is 0-12% higher (median 8%, eight runs on
2026-11-27) after one than after another transfer, so the dense delta refit is held against the full
refit of such a step (`dense_vs_full_stepped`). After each transfer, once every member is done (a
barrier, as syncd's Verify follows every member's transfer), the senders' mirrors take what they
sent, untimed, as a member's agent does on Verify (`commit s`: the slowest sender's copy). Reports
medians of the receiver's wall time per method, the bytes on the wire, and the receiver's and each
sender's seconds, the CPU seconds of all members' transfers, and the bound of delta refits: the dense
delta refit over the full refit of the same kind of step with delta refits off
(`dense_vs_full_stepped`, also by round and in CPU seconds; `dense_vs_full`: over the full refit of
unchanged weights, as reported before 2026-11-27). No vLLM: `bench/apply_bench.py` measures the
install.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from syncd.commands import DeltaLinks
from syncd.member.dataplane import (
    GcPause,
    LoopCache,
    LoopOptions,
    recv_buckets,
    send_buckets,
)
from syncd.member.dataplane.delta import Diffs, Mirror, recv_with_deltas, send_with_deltas
from syncd.weight_version import WeightVersion
from testkit.four_to_one import RECEIVER, SENDERS, add_model_args, join_rank, moe_plan, run_members

DENSE = "delta refit, every element changed (dense fallback)"
# A full refit right after a step that changes everything, as the dense delta refit runs.
FULL_STEPPED = "full refit, every element changed"


def _step(tensors: dict[str, torch.Tensor], fraction: float, gen: torch.Generator) -> None:
    """Move `fraction` of the elements by one bf16 step (their bits change, the rest keep theirs)."""
    for x in tensors.values():
        bits = x.view(torch.int16)
        hit = torch.rand(x.shape, generator=gen) < fraction
        bits[hit] += 1


def _member(rank: int, args: argparse.Namespace, address: str, results) -> None:
    r = join_rank(rank, args, address, "delta-bench")
    me, sending, ranks, views, transport = r.me, r.sending, r.ranks, r.views, r.transport
    mirror = Mirror()
    mine = r.plan.for_member(me)
    raw = torch.empty(sum(b.nbytes for b in mine), dtype=torch.uint8)
    rows = []

    barrier = r.barrier
    diffs: Diffs | None = None  # a sender's comparisons in the method running, committed after it

    def timed(name: str, fn) -> None:
        """`fn`'s transfer, then (untimed) a sender's mirror commit once every member's transfer is
        done, as a member's agent does on syncd's Verify while the trainer's step waits."""
        nonlocal diffs
        barrier()
        t0, cpu0 = time.perf_counter(), time.process_time()
        stats = fn()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        commit_s = commit_cpu = 0.0
        barrier()  # every member's transfer is done: syncd's Verify
        if sending and diffs is not None:
            c0, ccpu0 = time.perf_counter(), time.process_time()
            diffs.commit(views)
            commit_s, commit_cpu = time.perf_counter() - c0, time.process_time() - ccpu0
            diffs = None
        rows.append(
            {
                "method": name,
                "seconds": seconds,
                "cpu_seconds": cpu,  # all the process's threads (gloo's too)
                "commit_seconds": commit_s,  # the mirror's copy after the transfer (senders)
                "commit_cpu_seconds": commit_cpu,
                "bytes": getattr(stats, "bytes", raw.numel()),
                "changed": getattr(stats, "changed", None),
                "elements": getattr(stats, "elements", None),
            }
        )

    # What a member's agent keeps with its transport and holds while it transfers.
    options, cache = LoopOptions(120, gc_pause=GcPause()), LoopCache()

    def full():
        run = send_buckets if sending else recv_buckets
        return run(mine, views, transport, ranks, options, cache=cache)

    def delta():
        nonlocal diffs
        if sending:
            diffs = Diffs(mirror)
            return send_with_deltas(
                mine,
                views,
                transport,
                ranks,
                DeltaLinks(mirror.version, frozenset({RECEIVER}), 0.5),
                diffs,
                options,
                cache=cache,
            )
        links = DeltaLinks(WeightVersion(1), frozenset({RECEIVER}), 0.5)
        return recv_with_deltas(mine, views, transport, ranks, links, options, cache=cache)

    def raw_gloo():
        if sending:
            transport.isend(raw, ranks[RECEIVER]).wait(120)
        else:
            bufs = {
                s: torch.empty(sum(b.nbytes for b in mine if b.src == s), dtype=torch.uint8)
                for s in list(ranks)[:SENDERS]
            }
            for handle in [transport.irecv(buf, ranks[s]) for s, buf in bufs.items()]:
                handle.wait(120)

    def keep_mirror():  # a full refit with delta refits on: the senders' mirrors take what they sent
        nonlocal diffs
        if sending:
            diffs = Diffs(mirror)
            mirror.version = WeightVersion(1)  # the base of the bench's deltas
            return send_with_deltas(
                mine, views, transport, ranks, DeltaLinks(None, frozenset(), 0.5), diffs, options, cache=cache
            )
        return recv_buckets(mine, views, transport, ranks, options, cache=cache)

    for _ in range(args.rounds + 1):
        timed("raw gloo", raw_gloo)
        timed("full refit", full)
        if sending:
            _step(views, 1.0, r.gen)
        timed(FULL_STEPPED, full)
        timed("full refit, delta refits on (mirror kept)", keep_mirror)
        if sending:
            _step(views, args.changed, r.gen)
        timed(f"delta refit, RL-like step ({args.changed:.1%} of elements)", delta)
        if sending:
            _step(views, 1.0, r.gen)
        timed(DENSE, delta)
    results[me] = rows[len(rows) // (args.rounds + 1) :]  # the first round warms up
    transport.close()


def _by_round(rows: list[dict], method: str, baseline: str, key: str) -> list[float]:
    """`method`'s `key` over `baseline`'s, round by round (each method runs once per round)."""
    mine = [r[key] for r in rows if r["method"] == method]
    base = [r[key] for r in rows if r["method"] == baseline]
    return [a / b for a, b in zip(mine, base)]


def _cpu_by_round(results: dict, method: str) -> list[float]:
    """Per round, the CPU seconds of all members together for `method`."""
    per_member = [[r["cpu_seconds"] for r in rows if r["method"] == method] for rows in results.values()]
    return [sum(round_) for round_ in zip(*per_member)]


def _report_bound(report: dict, receiver: list[dict], suffix: str, baseline: str, against: str) -> None:
    """The dense step over `baseline` into `report` (`dense_vs_full{suffix}`: medians, by round and
    in CPU seconds), and printed."""
    methods = report["methods"]
    ratio = methods[DENSE]["seconds"] / methods[baseline]["seconds"]
    by_round = _by_round(receiver, DENSE, baseline, "seconds")
    cpu = methods[DENSE]["cpu_seconds"] / methods[baseline]["cpu_seconds"]
    report[f"dense_vs_full{suffix}"] = ratio
    report[f"dense_vs_full{suffix}_by_round"] = by_round
    report[f"dense_vs_full{suffix}_cpu"] = cpu
    print(
        f"{against}: {ratio:.2f} (medians), {statistics.median(by_round):.2f} (median of rounds), "
        f"{cpu:.2f} (CPU seconds)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--changed", type=float, default=0.01)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    _, _, plan = moe_plan(args)
    results = run_members(_member, args)
    receiver = results[RECEIVER]
    methods = list(dict.fromkeys(r["method"] for r in receiver))
    full = statistics.median(r["seconds"] for r in receiver if r["method"] == "full refit")
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "plan_bytes": plan.total_bytes,
        "buckets": len(plan.buckets),
        "layers": args.layers,
        "experts": args.experts,
        "rounds": args.rounds,
        "bucket_mib": args.bucket_mib,
        "load": os.getloadavg(),
        "methods": {},
    }
    print(
        f"{plan.total_bytes / 1e6:.1f} MB, {len(plan.buckets)} buckets, "
        f"{SENDERS} senders -> 1 receiver (gloo, CPU)"
    )
    print(
        f"{'method':<58} {'seconds':>8} {'vs full':>8} {'MB':>8} {'senders s (max)':>16} {'CPU s':>6} "
        f"{'commit s':>8}"
    )
    for m in methods:
        mine = [r for r in receiver if r["method"] == m]
        seconds = statistics.median(r["seconds"] for r in mine)
        senders = max(
            statistics.median(r["seconds"] for r in results[s] if r["method"] == m)
            for s in results
            if s != RECEIVER
        )
        row = {
            "seconds": seconds,
            "min": min(r["seconds"] for r in mine),
            "max": max(r["seconds"] for r in mine),
            "vs_full": seconds / full,
            "bytes": mine[0]["bytes"],
            "senders_max_seconds": senders,
            # the senders' mirror commit after the transfer (untimed above: the trainer's step waits)
            "senders_max_commit_seconds": max(
                statistics.median(r["commit_seconds"] for r in results[s] if r["method"] == m)
                for s in results
                if s != RECEIVER
            ),
            "cpu_seconds": statistics.median(_cpu_by_round(results, m)),
            "cpu_seconds_by_member": {
                member: statistics.median(r["cpu_seconds"] for r in rows if r["method"] == m)
                for member, rows in results.items()
            },
            "changed_fraction": (mine[0]["changed"] / mine[0]["elements"]) if mine[0]["elements"] else None,
        }
        report["methods"][m] = row
        print(
            f"{m:<58} {seconds:>8.3f} {seconds / full:>8.2f} {row['bytes'] / 1e6:>8.2f} {senders:>16.3f} "
            f"{row['cpu_seconds']:>6.3f} {row['senders_max_commit_seconds']:>8.3f}"
        )
    # The bound of the dense case: a step that changes everything, with delta refits on, against a
    # full refit with them off (at most 1.10), of the same kind of step (`_stepped`) and,
    # as before, of unchanged weights; also round by round (the two run seconds apart, so a
    # neighbour's load shifts both), and in CPU seconds of all members together.
    for suffix, baseline, against in (
        ("", "full refit", "dense with delta refits on / full refit with them off"),
        ("_stepped", FULL_STEPPED, "the same against a full refit of such a step"),
    ):
        _report_bound(report, receiver, suffix, baseline, against)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
