"""Refit benchmark: one trainer rank (expert-TP layout) -> one generator worker (vLLM layout).

    python bench/refit_bench.py --backend gloo --gib 0.25         # CPU (two processes)
    python bench/refit_bench.py --backend nccl --gib 8 --json OUT  # two GPUs

Measured in one run, on the same bytes:
  (a) raw:        one large buffer through the transport (the limit)
  (b) refit:      this project's plan + bucketed, double-buffered transfer with checksums
  (c) per-tensor: one broadcast per HF tensor, copied into vLLM's layout (what many RL
                  frameworks do)
  (d) gather+bcast: HF tensors packed into buckets and broadcast from one rank after gathering
                  the model there (with one trainer rank the gather is free), then unpacked
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from syncd.layout.dtypes import torch_dtype
from syncd.layout.hf_names import is_grouped_expert, split_to_hf
from syncd.member.dataplane import (
    GcPause,
    GlooTransport,
    LoopCache,
    LoopOptions,
    catalog_views,
    recv_buckets,
    send_buckets,
)
from syncd.member.dataplane.transport import Handle, Transport
from syncd.net import free_port
from syncd.plan import DestMember, SourceMember, make_plan
from testkit.synthetic_moe import MoeShape, shape_for, trainer_catalog, vllm_catalog

if TYPE_CHECKING:
    from syncd.member.dataplane.nccl import NcclTransport


def hf_regions(shape: MoeShape, catalog, views):
    """(HF name, tensor) pairs as the trainer would produce them from its local layout, without
    copies: views into its tensors."""
    pieces: dict[str, torch.Tensor] = {}
    for t in catalog.tensors:
        for p in t.pieces:
            region = views[t.name][p.local.slices()]
            pieces[p.canonical] = region.reshape(p.canon.shape)
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in pieces.items():
        out += split_to_hf(name, tensor, shape.experts) if is_grouped_expert(name) else [(name, tensor)]
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_rounds(methods: dict, device, reps: int) -> dict[str, list[float]]:
    """Seconds per method over `reps` rounds after one warm-up round. Each round runs every method
    once, so drift of the machine (clocks, neighbours) touches all methods alike."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for round_ in range(reps + 1):
        for name, fn in methods.items():
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            dist.barrier()
            if round_:
                times[name].append(time.perf_counter() - t0)
    return times


def _extra_memory_mib(fn, device, cache: LoopCache) -> float:
    """Peak GPU memory `fn` (a refit) adds, staging buffers included: measured from a cold pool."""
    if device.type != "cuda":
        return 0.0
    cache.clear()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def profile_run(fn, device, path: Path) -> None:
    """One run of `fn` under the torch profiler: a chrome trace (gzip) and a table of host time per
    labelled step (the executor labels pack, isend, waits, checksums, unpack)."""
    from torch.profiler import ProfilerActivity, profile

    # On GPUs only device activity: recording every host op would slow the host several-fold and
    # show a host-bound schedule that the unprofiled run does not have.
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    dist.barrier()
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    dist.barrier()
    prof.export_chrome_trace(str(path) + ".json")
    with open(str(path) + ".json", "rb") as f, gzip.open(str(path) + ".json.gz", "wb") as g:
        g.write(f.read())
    os.unlink(str(path) + ".json")
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60)
    Path(str(path) + ".txt").write_text(table)


class _TimedHandle:
    """A transfer's handle whose host waits add to their `_LinkTimer`'s."""

    def __init__(self, inner: Handle, timer: _LinkTimer) -> None:
        self.inner, self.timer = inner, timer

    def fence(self, timeout_s: float) -> None:
        self.inner.fence(timeout_s)

    def wait(self, timeout_s: float) -> None:
        start = time.perf_counter()
        self.inner.wait(timeout_s)
        self.timer.waited_s += time.perf_counter() - start


class _LinkTimer:
    """Wraps the NCCL transport to time each transfer with CUDA events (no profiler, so the host
    runs at its real speed): how busy the link was, and where it waited; and on the host, from
    the first transfer posted to the last, how long the loop waited for transfers (a loop that
    waits little there is what the link waits for)."""

    def __init__(self, inner: NcclTransport) -> None:
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (start, end) per transfer
        self.posted: list[float] = []  # host clock at each post
        self.waited_s = 0.0

    def clear(self) -> None:
        self.marks.clear()
        self.posted.clear()
        self.waited_s = 0.0

    def _timed(self, op: Callable[[torch.Tensor, int], Handle], buf: torch.Tensor, peer: int) -> Handle:
        stream = self.inner.stream
        stream.wait_stream(torch.cuda.current_stream())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)  # reached once the stream's waits (the packed bucket) are met
        self.posted.append(time.perf_counter())
        handle = op(buf, peer)
        end.record(stream)
        self.marks.append((start, end))
        return _TimedHandle(handle, self)

    def isend(self, buf: torch.Tensor, peer: int) -> Handle:
        return self._timed(self.inner.isend, buf, peer)

    def irecv(self, buf: torch.Tensor, peer: int) -> Handle:
        return self._timed(self.inner.irecv, buf, peer)

    def abort(self) -> None:
        self.inner.abort()

    def close(self) -> None:
        self.inner.close()

    def summary(self) -> dict:
        t0 = self.marks[0][0]
        spans = [(t0.elapsed_time(a), t0.elapsed_time(b)) for a, b in self.marks]
        busy = sum(b - a for a, b in spans)
        gaps = [max(0.0, nxt[0] - cur[1]) for cur, nxt in itertools.pairwise(spans)]
        return {
            "transfers": len(spans),
            "span_ms": round(spans[-1][1], 3),
            "busy_ms": round(busy, 3),
            "gaps_ms": round(sum(gaps), 3),
            "largest_gap_ms": round(max(gaps, default=0.0), 3),
            "longest_transfer_ms": round(max(b - a for a, b in spans), 3),
            "host_posting_ms": round((self.posted[-1] - self.posted[0]) * 1e3, 3),
            "host_waits_ms": round(self.waited_s * 1e3, 3),
        }


def worker(rank: int, args, port: int, out_path: str) -> None:
    backend = args.backend
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=300),
    )
    shape = shape_for(args.gib)
    src_cat, dst_cat = trainer_catalog(shape, 1, 0, 1, 0), vllm_catalog(shape, 1, 0)
    me = "trainer-0" if rank == 0 else "generator-0-0"
    plans = {
        mib: make_plan(
            [SourceMember("trainer-0", 0, src_cat)],
            [DestMember("generator-0-0", dst_cat)],
            bucket_bytes=mib << 20,
        )
        for mib in args.bucket_mib
    }
    ranks = {"trainer-0": 0, "generator-0-0": 1}
    catalog = src_cat if rank == 0 else dst_cat
    gen = torch.Generator(device=device).manual_seed(0)
    owned = {t.name: torch.empty(t.shape, dtype=torch_dtype(t.dtype), device=device) for t in catalog.tensors}
    for t in owned.values():
        t.copy_(
            torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32)
        ) if rank == 0 else t.zero_()
    views = catalog_views(catalog, owned)
    transport = _our_transport(backend, rank, device)
    headline = plans[args.bucket_mib[0]]
    total = headline.total_bytes
    result: dict = {
        "bytes": total,
        "units": headline.num_units,
        "hf_tensors": shape.hf_tensor_count(),
        "canonical_tensors": len(shape.canonical()),
        "buckets": {mib: len(p.buckets) for mib, p in plans.items()},
    }
    raw = torch.empty(total, dtype=torch.uint8, device=device)
    last = {}
    # What a member keeps with its transport, one per plan: a member refits with one plan until
    # its group changes, and a cache keeps one plan's prepared work (`retain_used`), so rounds
    # that take the plans in turn through one cache would time refits after a plan change.
    caches, gc_pause = {mib: LoopCache() for mib in plans}, GcPause()

    def refit(mib: int, verify: bool = True, graphs: bool = False):
        run = send_buckets if rank == 0 else recv_buckets
        options = LoopOptions(300, args.in_flight, verify=verify, graphs=graphs, gc_pause=gc_pause)
        last[mib] = run(plans[mib].for_member(me), views, transport, ranks, options, cache=caches[mib])

    result["extra_gpu_mib"] = {
        mib: _extra_memory_mib(partial(refit, mib), device, caches[mib]) for mib in plans
    }
    hf = hf_regions(shape, catalog, views)
    methods: dict[str, Callable[[], object]] = {"raw": partial(_raw_transfer, transport, raw, rank)}
    for mib in plans:
        methods[f"refit_noverify@{mib}"] = partial(refit, mib, verify=False)
        methods[f"refit@{mib}"] = partial(refit, mib)
        if args.graphs:
            methods[f"refit_graphs@{mib}"] = partial(refit, mib, graphs=True)
    methods["per_tensor"] = lambda: _per_tensor(hf, rank)
    methods["gather_bcast"] = lambda: _bucketed_bcast(hf, rank, args.bucket_mib[0] << 20, device)
    result["seconds"] = timed_rounds(methods, device, args.reps)
    del methods, raw  # frees the raw buffer (its partial holds it too)
    ok = {}
    for mib in plans:
        refit(mib)
        gathered: list[Any] = [None, None]  # both ranks' checksums, as all_gather_object fills it
        dist.all_gather_object(gathered, last[mib].checksums)
        ok[mib] = gathered[0] == gathered[1] and len(gathered[0]) == plans[mib].num_units
    result["checksums_ok"] = all(ok.values())
    if device.type == "cuda":  # where the link waits, from two more refits per size with timed transfers
        timed, result["link"] = _LinkTimer(transport), {}
        options = LoopOptions(300, args.in_flight, gc_pause=gc_pause)
        for mib in plans:
            run = send_buckets if rank == 0 else recv_buckets
            timed_cache = LoopCache()
            for _ in range(2):  # the first prepares the buckets' work: the second is timed
                timed.clear()
                run(plans[mib].for_member(me), views, timed, ranks, options, cache=timed_cache)
            _sync(device)
            both = [None, None]
            dist.all_gather_object(both, timed.summary())
            result["link"][mib] = {"sender": both[0], "receiver": both[1]}
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        profile_run(
            lambda: refit(args.bucket_mib[0]), device, Path(args.profile) / f"warmup-rank{rank}"
        )  # profiler start-up
        for mib in plans:
            profile_run(lambda m=mib: refit(m), device, Path(args.profile) / f"refit-{mib}mib-rank{rank}")
    transport.close()
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


def _raw_transfer(transport: Transport, raw: torch.Tensor, rank: int) -> None:
    """Baseline (a): one large buffer from rank 0 to rank 1."""
    (transport.isend(raw, 1) if rank == 0 else transport.irecv(raw, 0)).wait(300)


def _our_transport(backend: str, rank: int, device):
    box = [""]  # rank 0's address, broadcast to the other
    if backend == "nccl":
        from syncd.member.dataplane.nccl import NcclTransport

        if rank == 0:
            box[0] = NcclTransport.create_address()
        dist.broadcast_object_list(box, src=0)
        return NcclTransport.connect(box[0], rank, 2, device, 120)
    store = None
    if rank == 0:
        box[0], store = GlooTransport.create_address("127.0.0.1", 2, 120)
    dist.broadcast_object_list(box, src=0)
    return GlooTransport.connect(box[0], rank, 2, "bench", 300, store)


def _per_tensor(hf, rank: int) -> None:
    """Baseline (c): a broadcast per HF tensor; the receiver copies each into vLLM's layout."""
    for _, region in hf:
        if rank == 0:
            dist.broadcast(region.contiguous(), src=0)
        else:
            tmp = torch.empty(region.shape, dtype=region.dtype, device=region.device)
            dist.broadcast(tmp, src=0)
            region.copy_(tmp)


def _bucketed_bcast(hf, rank: int, bucket_bytes: int, device) -> None:
    """Baseline (d): HF tensors packed into buckets, broadcast, unpacked into vLLM's layout."""
    buf = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    batch: list[tuple[str, torch.Tensor]] = []
    size = 0
    for item in [*hf, None]:
        nbytes = item[1].numel() * item[1].element_size() if item else 0
        if batch and (item is None or size + nbytes > bucket_bytes):
            offset = 0
            for _, region in batch:
                n = region.numel() * region.element_size()
                if rank == 0:
                    buf[offset : offset + n].view(region.dtype).view(region.shape).copy_(region)
                offset += n
            dist.broadcast(buf[:offset], src=0)
            if rank == 1:
                offset = 0
                for _, region in batch:
                    n = region.numel() * region.element_size()
                    region.copy_(buf[offset : offset + n].view(region.dtype).view(region.shape))
                    offset += n
            batch, size = [], 0
        if item is not None:
            if nbytes > bucket_bytes:  # a tensor larger than a bucket goes alone
                buf = torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes > buf.numel() else buf
            batch.append(item)
            size += nbytes


def spawn_workers(worker, args, nprocs: int) -> dict:
    """Run `worker(rank, args, port, out_path)` in `nprocs` processes rendezvousing on a free local
    port; returns the JSON object rank 0 wrote to `out_path`."""
    port = free_port()
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_{os.getpid()}.json"
    mp.spawn(worker, args=(args, port, str(out)), nprocs=nprocs, join=True)
    try:
        return json.loads(out.read_text())
    finally:
        out.unlink()


def _mib_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"bucket sizes must be positive MiB, e.g. 256,1024; got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--gib", type=float, default=0.25, help="model size to move")
    parser.add_argument(
        "--bucket-mib",
        type=_mib_list,
        default=[64],
        help="bucket sizes to measure, comma-separated; the first is the headline",
    )
    parser.add_argument("--in-flight", type=int, default=2, help="staging buffers per side")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--profile", help="also write torch profiler traces and tables of one refit here")
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="also measure the refit with each bucket's work as CUDA graphs (syncd.member.dataplane.graphs)",
    )
    args = parser.parse_args()
    r = spawn_workers(worker, args, 2)
    summary = summarize(r, args)
    print(report(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


def summarize(r: dict, args) -> dict:
    """Medians in GB/s, the headline ratios (first bucket size), the sweep and each method's spread."""
    gb = r["bytes"] / 1e9
    med = {name: statistics.median(t) for name, t in r["seconds"].items()}
    head = args.bucket_mib[0]

    def gbps(name: str) -> float:
        return round(gb / med[name], 3)

    return {
        "backend": args.backend,
        "bytes": r["bytes"],
        "raw_gbps": gbps("raw"),
        "refit_gbps": gbps(f"refit@{head}"),
        "per_tensor_gbps": gbps("per_tensor"),
        "gather_bcast_gbps": gbps("gather_bcast"),
        "refit_noverify_gbps": gbps(f"refit_noverify@{head}"),
        "refit_vs_raw": round(med["raw"] / med[f"refit@{head}"], 3),
        "refit_vs_per_tensor": round(med["per_tensor"] / med[f"refit@{head}"], 3),
        "refit_vs_gather_bcast": round(med["gather_bcast"] / med[f"refit@{head}"], 3),
        "checksums_ok": r["checksums_ok"],
        "extra_gpu_mib": round(r["extra_gpu_mib"][str(head)], 1),
        "hf_tensors": r["hf_tensors"],
        "bucket_mib": head,
        "in_flight": args.in_flight,
        "reps": args.reps,
        "sweep": [
            {
                "bucket_mib": mib,
                "buckets": r["buckets"][str(mib)],
                "refit_gbps": gbps(f"refit@{mib}"),
                "refit_noverify_gbps": gbps(f"refit_noverify@{mib}"),
                "refit_vs_raw": round(med["raw"] / med[f"refit@{mib}"], 3),
                **(
                    {"refit_graphs_gbps": gbps(f"refit_graphs@{mib}")} if f"refit_graphs@{mib}" in med else {}
                ),
                "extra_gpu_mib": round(r["extra_gpu_mib"][str(mib)], 1),
            }
            for mib in args.bucket_mib
        ],
        "link": r.get("link", {}),
        "gbps_min_max": {
            name: [round(gb / max(t), 3), round(gb / min(t), 3)] for name, t in r["seconds"].items()
        },
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(0)
        if args.backend == "nccl"
        else f"CPU ({os.cpu_count()} cores)",
    }


def report(s: dict) -> str:
    gb = s["bytes"] / 1e9
    lines = [
        (
            f"{s['backend']}: {gb:.2f} GB, {s['hf_tensors']} HF tensors, median of {s['reps']} rounds, "
            f"checksums ok: {s['checksums_ok']}, staging depth {s['in_flight']}"
        ),
        f"{'method':<34} {'GB/s':>8} {'vs raw':>7} {'min-max GB/s':>16}",
    ]
    spread = s["gbps_min_max"]

    def row(label: str, key: str, value: float) -> str:
        lo, hi = spread[key]
        return f"{label:<34} {value:>8.1f} {value / s['raw_gbps']:>7.2f} {lo:>7.1f}-{hi:<8.1f}"

    lines.append(row("(a) raw (one buffer)", "raw", s["raw_gbps"]))
    for w in s["sweep"]:
        mib = w["bucket_mib"]
        lines.append(row(f"(b) refit, {mib} MiB buckets", f"refit@{mib}", w["refit_gbps"]))
        lines.append(row("    without checksums", f"refit_noverify@{mib}", w["refit_noverify_gbps"]))
        if "refit_graphs_gbps" in w:
            lines.append(row("    with CUDA graphs", f"refit_graphs@{mib}", w["refit_graphs_gbps"]))
    lines.append(row("(c) per-tensor broadcast", "per_tensor", s["per_tensor_gbps"]))
    lines.append(row("(d) gather + bucketed broadcast", "gather_bcast", s["gather_bcast_gbps"]))
    for mib, sides in s["link"].items():
        for side, link in sides.items():
            lines.append(
                f"{side} link, {mib} MiB buckets: {link['busy_ms']:.2f} ms transferring in a "
                f"{link['span_ms']:.2f} ms span ({link['transfers']} transfers), "
                f"{link['gaps_ms']:.2f} ms idle between them (largest {link['largest_gap_ms']:.2f}), "
                f"longest transfer {link['longest_transfer_ms']:.2f} ms; host: "
                f"{link['host_waits_ms']:.2f} ms of waits in {link['host_posting_ms']:.2f} ms of posting"
            )
    lines.append(
        f"headline ({s['bucket_mib']} MiB): refit = {s['refit_vs_raw']:.2f} x raw, "
        f"{s['refit_vs_per_tensor']:.1f} x per-tensor, {s['refit_vs_gather_bcast']:.1f} x gather+bcast; "
        f"extra GPU memory {s['extra_gpu_mib']:.0f} MiB"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
