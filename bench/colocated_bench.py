"""Colocated refit benchmark: a trainer process and a receiver process in vLLM's layout on one host,
the refit over the same-host transport against the copy and wire it must beat, all in one run.

    python bench/colocated_bench.py --json OUT.json [--gib 0.3] [--bucket-mib 64] [--reps 5]

It starts two processes, one torch thread each (sender: the synthetic Qwen3-MoE-like model of
`refit_bench.py` in the expert-TP trainer layout; receiver: vLLM's fused layout) and measures, in
the receiver:
  - memcpy_gbps: one thread copying the same number of bytes (torch, one intra-op thread);
  - raw_gloo_gbps: the same bytes over the processes' gloo group, no packing, no checksums;
  - refit_gbps: `send_buckets`/`recv_buckets` over `ShmTransport` (shared memory) with checksums,
    ended as the agent ends a refit (`end_refit`: the segments' names go, the mappings a refit
    used stay for the next, as the loops keep their staging over gloo);
  - refit_gloo_gbps: the same refit over gloo, the path colocated members took before;
  - pack_loop_gbps / unpack_loop_gbps: the sender's or the receiver's loop alone, with checksums,
    over a wire that moves nothing (`testkit.loopback_transport.NullTransport`): the refit's ceiling
    from packing and unpacking, whatever the transport;
  - checksums: both sides' per-unit checksums agree; bit_exact: every destination region holds the
    source's bits after the last refit.
GB/s are 1e9 bytes per second of the plan's bytes, medians of `--reps` rounds; each round runs
every method once (a drifting, shared machine touches all alike), the first warms up.
Which `syncd` it measures is whatever Python imports (PYTHONPATH). COLOCATED_BENCH_LAUNCH (words
put between the interpreter and this script in the member processes' command line, e.g. a
profiling wrapper) is for looking inside one member.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: that `syncd` wins

import torch
import torch.distributed as dist

import syncd
from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane import (
    GcPause,
    GlooTransport,
    LoopCache,
    LoopOptions,
    catalog_views,
    recv_buckets,
    send_buckets,
)
from syncd.member.dataplane.shm import ShmTransport
from syncd.net import free_port
from syncd.plan import DestMember, SourceMember, make_plan
from testkit.loopback_transport import NullTransport
from testkit.synthetic_moe import shape_for, trainer_catalog, vllm_catalog

_SRC, _DST = "trainer-0", "generator-0-0"
_RANKS = {_SRC: 0, _DST: 1}
_TIMEOUT_S = 300
_LAUNCH = [a for a in os.environ.get("COLOCATED_BENCH_LAUNCH", "").split() if a]


def _barrier(store: dist.Store, name: str, rank: int) -> None:
    store.set(f"{name}/{rank}", "1")
    store.wait([f"{name}/0", f"{name}/1"], datetime.timedelta(seconds=_TIMEOUT_S))


def _tensors(catalog, fill, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        t.name: fill(torch.empty(t.shape, dtype=torch_dtype(t.dtype), device=device)) for t in catalog.tensors
    }


def _source(src_cat, device: torch.device) -> dict[str, torch.Tensor]:
    """The trainer's weights: the same random bits in whichever process builds them."""
    gen = torch.Generator(device=device).manual_seed(0)
    return _tensors(src_cat, lambda t: t.copy_(torch.randn(t.shape, generator=gen, device=device)), device)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


_COPY: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _memcpy(nbytes: int) -> None:
    """One thread copying `nbytes` (the buffers touched first and kept: the copy, not page faults)."""
    if nbytes not in _COPY:
        _COPY[nbytes] = (torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8))
    src, dst = _COPY[nbytes]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dst.copy_(src)
    finally:
        torch.set_num_threads(threads)


class _Member:
    """One side of the benchmark: its tensors, its group and what it keeps between refits."""

    def __init__(self, rank: int, store: dist.Store, args: argparse.Namespace) -> None:
        self.rank, self.store, self.args = rank, store, args
        device = torch.device("cpu")
        shape = shape_for(args.gib)
        self.src_cat, self.dst_cat = trainer_catalog(shape, 1, 0, 1, 0), vllm_catalog(shape, 1, 0)
        self.plan = make_plan(
            [SourceMember(_SRC, 0, self.src_cat)],
            [DestMember(_DST, self.dst_cat)],
            bucket_bytes=args.bucket_mib << 20,
        )
        if rank == 0:
            self.views = catalog_views(self.src_cat, _source(self.src_cat, device))
        else:
            self.views = catalog_views(
                self.dst_cat, _tensors(self.dst_cat, lambda t: t.fill_(float("nan")), device)
            )
        self.gloo = GlooTransport(store, rank, 2, "colocated-bench", _TIMEOUT_S)
        self.shm = ShmTransport(self.gloo, [1 - rank], "colocated-bench", _TIMEOUT_S)
        self.caches = {
            "shm": LoopCache(self.shm.allocate),
            "gloo": LoopCache(),
            "send": LoopCache(),
            "recv": LoopCache(),
        }
        self._src_views: dict[str, torch.Tensor] | None = None
        self.options = LoopOptions(_TIMEOUT_S, verify=True, gc_pause=GcPause())
        self.checksums: dict[str, str] = {}

    def raw_gloo(self) -> None:
        """The plan's bytes in buckets of the same size, straight between two flat buffers."""
        total, step = self.plan.total_bytes, self.args.bucket_mib << 20
        flat = getattr(self, "_flat", None)
        if flat is None:
            flat = self._flat = torch.ones(total, dtype=torch.uint8)
        post = self.gloo.isend if self.rank == 0 else self.gloo.irecv
        handles = [post(flat[i : i + step], 1 - self.rank) for i in range(0, total, step)]
        for h in handles:
            h.wait(_TIMEOUT_S)

    def refit(self, over: str) -> None:
        transport = self.shm if over == "shm" else self.gloo
        loop = send_buckets if self.rank == 0 else recv_buckets
        me = _SRC if self.rank == 0 else _DST
        stats = loop(
            self.plan.for_member(me), self.views, transport, _RANKS, self.options, cache=self.caches[over]
        )
        self.checksums = stats.checksums
        if over == "shm":  # what the agent does when a refit's transfer ended
            self.shm.end_refit()

    def rounds(self, methods: dict, reps: int) -> dict[str, list[float]]:
        """Seconds per method; each round runs every method once, both processes starting each
        together (drift touches all alike); the first round warms up."""
        times: dict[str, list[float]] = {name: [] for name in methods}
        for round_ in range(reps + 1):
            for name, fn in methods.items():
                _barrier(self.store, f"{name}/{round_}", self.rank)
                t0 = time.perf_counter()
                fn()
                seconds = time.perf_counter() - t0  # the receiver's: until the last bucket is in place
                _barrier(self.store, f"{name}/{round_}/done", self.rank)
                if round_:
                    times[name].append(seconds)
        return times

    def loop_alone(self, direction: str) -> None:
        """One side's loop with checksums over a wire that moves nothing (`NullTransport`), in the
        receiver's process while the sender waits: what packing or unpacking alone costs."""
        if self.rank == 0:
            return
        if direction == "send":
            if self._src_views is None:
                self._src_views = catalog_views(self.src_cat, _source(self.src_cat, torch.device("cpu")))
            bucket_list, views, loop = self.plan.for_member(_SRC), self._src_views, send_buckets
        else:
            bucket_list, views, loop = self.plan.for_member(_DST), self.views, recv_buckets
        loop(bucket_list, views, NullTransport(), _RANKS, self.options, cache=self.caches[direction])

    def bit_exact(self) -> bool:
        """Every destination region holds the source region's bits."""
        src = catalog_views(self.src_cat, _source(self.src_cat, torch.device("cpu")))
        for b in self.plan.buckets:
            for u in b.units:
                sent = src[u.src_tensor][u.src_box.slices()].reshape(-1)
                got = self.views[u.dst_tensor][u.dst_box.slices()].reshape(-1)
                if not torch.equal(sent.view(torch.uint8), got.view(torch.uint8)):
                    return False
        return True


def member_main(rank: int, port: int, args: argparse.Namespace) -> None:
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=_TIMEOUT_S)
    )
    if args.device == "cuda":
        from bench.colocated_cuda import cuda_member

        result = cuda_member(rank, store, args)
        if result is not None:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return
    m = _Member(rank, store, args)
    total = m.plan.total_bytes
    # The receiver copies alone while the sender waits at the barrier.
    memcpy = (lambda: _memcpy(total)) if rank == 1 else (lambda: None)
    seconds = m.rounds(
        {
            "memcpy": memcpy,
            "raw_gloo": m.raw_gloo,
            "refit": lambda: m.refit("shm"),
            "refit_gloo": lambda: m.refit("gloo"),
            "pack_loop": lambda: m.loop_alone("send"),
            "unpack_loop": lambda: m.loop_alone("recv"),
        },
        args.reps,
    )
    if rank == 1:  # the bit-exact check sees only what the last refit, over shared memory, wrote
        for t in m.views.values():
            t.fill_(float("nan"))
    m.refit("shm")
    store.set(f"checksums/{rank}", json.dumps(m.checksums))
    store.wait(["checksums/0", "checksums/1"], datetime.timedelta(seconds=_TIMEOUT_S))
    agree = json.loads(store.get("checksums/0")) == json.loads(store.get("checksums/1"))
    exact = m.bit_exact() if rank == 1 else True
    m.shm.close()
    if rank == 0:
        return
    med = {k: statistics.median(v) for k, v in seconds.items()}
    result = {
        "device": "cpu",
        "memcpy_gbps": _gbps(total, med["memcpy"]),
        "raw_gloo_gbps": _gbps(total, med["raw_gloo"]),
        "refit_gbps": _gbps(total, med["refit"]),
        "refit_gloo_gbps": _gbps(total, med["refit_gloo"]),
        "pack_loop_gbps": _gbps(total, med["pack_loop"]),
        "unpack_loop_gbps": _gbps(total, med["unpack_loop"]),
        "checksums": agree and len(m.checksums) == m.plan.num_units,
        "bit_exact": exact,
        "bytes": total,
        "buckets": len(m.plan.buckets),
        "bucket_mib": args.bucket_mib,
        "reps": args.reps,
        "seconds": {k: [round(s, 4) for s in v] for k, v in seconds.items()},
    }
    result["refit_over_memcpy"] = round(result["refit_gbps"] / result["memcpy_gbps"], 3)
    result["refit_over_raw_gloo"] = round(result["refit_gbps"] / result["raw_gloo_gbps"], 3)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where the result goes")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: both members on GPU 0")
    ap.add_argument("--gib", type=float, help="model size (default 0.3 GiB on CPU, over 256 MB; 4 on cuda)")
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a member process
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.gib = args.gib or (4.0 if args.device == "cuda" else 0.3)
    if args.rank is not None:
        member_main(args.rank, args.port, args)
        return
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False)  # noqa: F841 - hosts the rendezvous
    base = [
        sys.executable,
        *_LAUNCH,
        __file__,
        "--json",
        args.json,
        "--gib",
        str(args.gib),
        "--device",
        args.device,
        "--port",
        str(port),
    ]
    base += ["--bucket-mib", str(args.bucket_mib), "--reps", str(args.reps)]
    # One torch thread per member, as the demo runs its trainer ranks: two processes each with a
    # pool of spinning OpenMP threads on a 2-core machine slow every copy tenfold.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([*base, "--rank", str(r)], env=env) for r in (0, 1)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"member processes exited with {codes}")
    result = json.loads(Path(args.json).read_text())
    result.update(
        syncd=str(Path(syncd.__file__).parent),
        load_average=[round(x, 2) for x in os.getloadavg()],
        cpus=os.cpu_count(),
        torch=torch.__version__,
        python=platform.python_version(),
        measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
