"""Summarize a torch profiler trace of one refit (written by `refit_bench.py --profile`).

    python bench/trace_summary.py DIR/refit-256mib-rank0.json.gz

Prints the GPU time per stream, how long the link sat idle between NCCL kernels (and what the
GPU ran meanwhile), and the host time of each labelled executor step. The question it answers:
what keeps the refit from running at the raw NCCL bandwidth.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json
from dataclasses import dataclass, field


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


@dataclass
class _StreamUse:
    """One CUDA stream's GPU time in a trace: in all, in how many ops, and by kernel name."""

    busy_us: float = 0.0
    ops: int = 0
    us_by_name: collections.Counter[str] = field(default_factory=collections.Counter)


def summarize(events: list[dict]) -> str:
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    lines = [] if gpu else ["no GPU activity in the trace"]
    if gpu:
        lines += _gpu_summary(gpu)
    host: collections.defaultdict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])  # us, calls
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"].startswith("weightsync."):
            host[e["name"]][0] += e.get("dur", 0)
            host[e["name"]][1] += 1
    if host:
        lines.append("host time per executor step:")
        for name, (us, n) in sorted(host.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"  {name:<24} {us / 1e3:8.3f} ms in {n:5d} calls ({us / n:7.1f} us each)")
    return "\n".join(lines)


def _gpu_summary(gpu: list[dict]) -> list[str]:
    nccl = sorted((e for e in gpu if e["name"].startswith("nccl")), key=lambda e: e["ts"])
    start = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    lines = [f"GPU span {(end - start) / 1e3:.3f} ms"]
    per_stream: collections.defaultdict[str, _StreamUse] = collections.defaultdict(_StreamUse)
    for e in gpu:
        s = per_stream[e["args"].get("stream", "?")]
        s.busy_us += e["dur"]
        s.ops += 1
        s.us_by_name[e["name"][:50]] += e["dur"]
    for stream, s in sorted(per_stream.items(), key=lambda kv: -kv[1].busy_us):
        top = ", ".join(f"{name} {us / 1e3:.2f} ms" for name, us in s.us_by_name.most_common(3))
        lines.append(f"  stream {stream}: {s.busy_us / 1e3:.3f} ms busy in {s.ops} ops ({top})")
    if nccl:
        busy = sum(e["dur"] for e in nccl)
        lines.append(
            f"NCCL kernels: {len(nccl)}, {busy / 1e3:.3f} ms; from first start to last end "
            f"{(nccl[-1]['ts'] + nccl[-1]['dur'] - nccl[0]['ts']) / 1e3:.3f} ms"
        )
        lines.append(
            f"  before the first NCCL kernel: {(nccl[0]['ts'] - start) / 1e3:.3f} ms; "
            f"after the last: {(end - nccl[-1]['ts'] - nccl[-1]['dur']) / 1e3:.3f} ms"
        )
        gaps = [(b["ts"] - (a["ts"] + a["dur"]), a, b) for a, b in itertools.pairwise(nccl)]
        total_gap = sum(max(0.0, g) for g, _, _ in gaps)
        lines.append(
            f"  idle link between NCCL kernels: {total_gap / 1e3:.3f} ms in {len(gaps)} gaps; "
            f"largest: " + ", ".join(f"{g:.0f} us" for g, _, _ in sorted(gaps, key=lambda x: -x[0])[:5])
        )
        durs = sorted(e["dur"] for e in nccl)
        lines.append(
            f"  NCCL kernel durations: min {durs[0]:.0f} us, median {durs[len(durs) // 2]:.0f} us, "
            f"max {durs[-1]:.0f} us"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    for path in parser.parse_args().traces:
        print(f"== {path}")
        print(summarize(load(path)))


if __name__ == "__main__":
    main()
