"""Loop-back refit benchmark on one GPU: the executor's real pack -> checksum -> wire -> unpack ->
checksum pipeline, with a device copy standing in for the wire (`testkit/loopback_transport.py`).

    python bench/loopback_bench.py --gib 8 --bucket-mib 512,256,64 --json OUT.json [--profile DIR]

It moves the synthetic Qwen3-30B-A3B-like model of `refit_bench.py` from the expert-TP trainer
layout into vLLM's layout on the same GPU, and reports per bucket size, in one run:
  - GB/s of the refit with and without checksums, against one device-to-device copy of the same
    bytes (the run's ceiling for a pipeline that must at least read and write every byte once);
  - host launches per bucket (kernels, copies, memsets the CUDA runtime was asked for), counted
    with the torch profiler and split by executor step (pack, checksum, wire, unpack);
  - the wire's timeline of an unprofiled refit: how long it sat idle between bucket copies.
With --profile, a chrome trace of one refit at the smallest bucket size goes to DIR.
Which `syncd` it measures is whatever Python imports (PYTHONPATH), and the JSON names it, so the
same script measures the tree before and after a change in one call.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: that `syncd` wins

import torch
from torch.profiler import ProfilerActivity, profile

import syncd
from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane import LoopCache, LoopOptions, catalog_views, recv_buckets, send_buckets
from syncd.plan import DestMember, SourceMember, make_plan
from testkit.loopback_transport import LoopbackWire, NullTransport
from testkit.synthetic_moe import shape_for, trainer_catalog, vllm_catalog

_SRC, _DST = "trainer-0", "generator-0-0"
_RANKS = {_SRC: 0, _DST: 1}
# Host calls that put work on the GPU: one per kernel, copy or memset.
_LAUNCHES = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
    "cudaGraphLaunch",
)


class Setup:
    """Both members' tensors on one GPU: random trainer weights, a receiver filled with NaN."""

    def __init__(self, gib: float, device: torch.device) -> None:
        self.shape = shape_for(gib)
        self.src_cat, self.dst_cat = trainer_catalog(self.shape, 1, 0, 1, 0), vllm_catalog(self.shape, 1, 0)
        gen = torch.Generator(device=device).manual_seed(0)

        def owned(catalog, fill):
            return {
                t.name: fill(torch.empty(t.shape, dtype=torch_dtype(t.dtype), device=device))
                for t in catalog.tensors
            }

        src = owned(self.src_cat, lambda t: t.copy_(torch.randn(t.shape, generator=gen, device=device)))
        dst = owned(self.dst_cat, lambda t: t.fill_(float("nan")))
        self.src, self.dst = catalog_views(self.src_cat, src), catalog_views(self.dst_cat, dst)
        self.wire = LoopbackWire(device)
        # One per side and kept, with the loops' cache of each (staging, captured graphs), as a
        # member keeps them with its transport.
        self.null = {"send": NullTransport(), "recv": NullTransport()}
        self.null_caches = {"send": LoopCache(), "recv": LoopCache()}

    def plan(self, mib: int):
        return make_plan(
            [SourceMember(_SRC, 0, self.src_cat)], [DestMember(_DST, self.dst_cat)], bucket_bytes=mib << 20
        )

    def refit(self, plan, verify: bool = True, graphs: bool = False):
        """Both loops at once, each in its own thread; returns (sender stats, receiver stats)."""
        return self.wire.refit(plan, (_SRC, self.src), (_DST, self.dst), verify=verify, graphs=graphs)

    def check(self, plan) -> bool:
        """Every unit's destination region holds the source region's bits, and both sides'
        checksums agree on every unit."""
        sent, received = self.refit(plan)
        for b in plan.buckets:
            for u in b.units:
                a = self.src[u.src_tensor][u.src_box.slices()].reshape(-1)
                d = self.dst[u.dst_tensor][u.dst_box.slices()].reshape(-1)
                if not torch.equal(a, d):
                    return False
        return sent.checksums == received.checksums and len(sent.checksums) == plan.num_units


class GcPauses:
    """Python's garbage-collector pauses while active: a full collection in a process holding
    torch can take tens of milliseconds, and the host enqueues nothing meanwhile."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)

    def summary(self) -> dict:
        by_gen = {g: [s for gen, s in self.pauses if gen == g] for g in (0, 1, 2)}
        return {
            f"gen{g}": {
                "count": len(v),
                "max_ms": round(1e3 * max(v, default=0.0), 2),
                "total_ms": round(1e3 * sum(v), 2),
            }
            for g, v in by_gen.items()
        }


def timed_rounds(methods: dict, reps: int) -> dict[str, list[float]]:
    """Seconds per method; each round runs every method once (drift touches all alike), the first
    round warms up."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for round_ in range(reps + 1):
        for name, fn in methods.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if round_:
                times[name].append(time.perf_counter() - t0)
    return times


def _step_of(event) -> str:
    """The executor step (record_function label) a host call ran under, or 'other'."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("weightsync."):
            return parent.name.removeprefix("weightsync.")
        parent = parent.cpu_parent
    return "other"


def launches(
    setup: Setup, plan, verify: bool = True, trace: Path | None = None, graphs: bool = False
) -> dict:
    """Host launches of each side's loop in a refit after the first (steady state), run alone in
    this thread over a `NullTransport` (the profiler sees only the thread that started it), by
    executor step, with the host milliseconds of each step under the profiler; optionally the
    chrome trace."""
    out = {}
    options = LoopOptions(120, verify=verify, graphs=graphs, gc_pause=setup.wire.gc_pause)
    for side, fn, member, views in (
        ("send", send_buckets, _SRC, setup.src),
        ("recv", recv_buckets, _DST, setup.dst),
    ):

        def run(fn=fn, member=member, views=views, side=side):  # this iteration's, bound now
            fn(
                plan.for_member(member),
                views,
                setup.null[side],
                _RANKS,
                options,
                cache=setup.null_caches[side],
            )
            torch.cuda.synchronize()

        run()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
        if trace is not None:
            prof.export_chrome_trace(str(trace).replace(".json", f"-{side}.json"))
        events = prof.events()
        per_step = Counter(_step_of(e) for e in events if e.name in _LAUNCHES)
        host_ms: Counter[str] = Counter()
        for e in events:
            if e.name.startswith("weightsync."):
                host_ms[e.name.removeprefix("weightsync.")] += e.cpu_time_total / 1e3
        out[side] = {
            "launches": sum(per_step.values()),
            "by_step": dict(per_step),
            "host_ms_by_step": {k: round(v, 2) for k, v in host_ms.items()},
        }
    return out


def measure(setup: Setup, mibs: list[int], reps: int, profile_dir: Path | None, graphs_too: bool) -> dict:
    """Every method in interleaved rounds; then per bucket size launches, wire timeline, bit check.
    With `graphs_too` (a tree whose executor has the `graphs` option) also the refit with the
    per-bucket work as CUDA graphs, as `refit_graphs@MiB`."""
    plans = {mib: setup.plan(mib) for mib in mibs}
    nbytes = plans[mibs[0]].total_bytes
    a, b = (
        torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
        torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
    )
    methods: dict[str, Callable[[], object]] = {"copy": partial(b.copy_, a)}
    for mib, plan in plans.items():
        methods[f"refit@{mib}"] = partial(setup.refit, plan)
        methods[f"refit_noverify@{mib}"] = partial(setup.refit, plan, verify=False)
        if graphs_too:
            methods[f"refit_graphs@{mib}"] = partial(setup.refit, plan, graphs=True)
    with GcPauses() as pauses:
        seconds = timed_rounds(methods, reps)
    del methods, a, b  # frees the copy buffers (the partials hold them too)
    med = {name: statistics.median(t) for name, t in seconds.items()}
    sizes = []
    for mib, plan in plans.items():
        setup.wire.marks.clear()
        setup.refit(plan)
        wire = setup.wire.timeline()
        counted = launches(setup, plan)
        counted_noverify = launches(setup, plan, verify=False)
        per_bucket = {side: round(c["launches"] / len(plan.buckets), 2) for side, c in counted.items()}
        sizes.append(
            {
                "bucket_mib": mib,
                "buckets": len(plan.buckets),
                "units": plan.num_units,
                "refit_gbps": round(nbytes / med[f"refit@{mib}"] / 1e9, 1),
                "refit_noverify_gbps": round(nbytes / med[f"refit_noverify@{mib}"] / 1e9, 1),
                "refit_vs_copy": round(med["copy"] / med[f"refit@{mib}"], 3),
                "launches_per_bucket": per_bucket,
                "launches_per_bucket_noverify": {
                    side: round(c["launches"] / len(plan.buckets), 2) for side, c in counted_noverify.items()
                },
                "launches": counted,
                "wire": wire,
                "bits_ok": setup.check(plan),
            }
        )
        if graphs_too:
            graphed = launches(setup, plan, graphs=True)
            sizes[-1].update(
                {
                    "refit_graphs_gbps": round(nbytes / med[f"refit_graphs@{mib}"] / 1e9, 1),
                    "launches_per_bucket_graphs": {
                        side: round(c["launches"] / len(plan.buckets), 2) for side, c in graphed.items()
                    },
                    "launches_graphs": graphed,
                }
            )
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
        smallest = min(mibs)
        launches(setup, plans[smallest], trace=profile_dir / f"loopback-{smallest}mib.json")
        # Both sides together, for the GPU timeline (CUDA activity is recorded from every thread).
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            setup.refit(plans[smallest])
        prof.export_chrome_trace(str(profile_dir / f"loopback-{smallest}mib-both.json"))
    return {
        "bytes": nbytes,
        "copy_gbps": round(nbytes / med["copy"] / 1e9, 1),
        "sizes": sizes,
        "gc_pauses_during_rounds": pauses.summary(),
        "gbps_min_max": {
            k: [round(nbytes / max(t) / 1e9, 1), round(nbytes / min(t) / 1e9, 1)] for k, t in seconds.items()
        },
    }


def report(r: dict) -> str:
    lines = [
        (
            f"loop-back refit [{r['label']}], {r['bytes'] / 1e9:.2f} GB on {r['device']}, {r['date']}, "
            f"median of {r['reps']} rounds; device-to-device copy of the same bytes: "
            f"{r['copy_gbps']:.1f} GB/s"
        ),
        (
            f"{'bucket':>8} {'buckets':>7} {'GB/s':>7} {'no-ck':>7} {'vs copy':>7} "
            f"{'launches/bucket send+recv':>25} {'no-ck':>11} {'wire idle ms':>12} {'largest gap':>11} "
            f"{'bits ok':>7}"
        ),
    ]
    lines.extend(
        f"{s['bucket_mib']:>5} MiB {s['buckets']:>7} {s['refit_gbps']:>7.1f} "
        f"{s['refit_noverify_gbps']:>7.1f} {s['refit_vs_copy']:>7.2f} "
        f"{_pair(s['launches_per_bucket']):>25} {_pair(s['launches_per_bucket_noverify']):>11} "
        f"{s['wire']['idle_ms']:>12.2f} {s['wire']['largest_gap_ms']:>11.2f} {s['bits_ok']!s:>7}"
        for s in r["sizes"]
    )
    lines.append(f"  GC pauses during the timed rounds: {r['gc_pauses_during_rounds']}")
    for s in r["sizes"]:
        if "refit_graphs_gbps" in s:
            lines.append(
                f"  {s['bucket_mib']} MiB with CUDA graphs: {s['refit_graphs_gbps']:.1f} GB/s, "
                f"launches/bucket {_pair(s['launches_per_bucket_graphs'])}"
            )
        for side, c in s["launches"].items():
            lines.append(
                f"  {s['bucket_mib']} MiB {side}: launches by step {c['by_step']}; "
                f"host ms by step (profiled) {c['host_ms_by_step']}"
            )
    return "\n".join(lines)


def _pair(per_side: dict) -> str:
    return f"{per_side['send']:.2f}+{per_side['recv']:.2f}"


def _mib_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"bucket sizes must be positive MiB, e.g. 512,256,64; got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="model size to move")
    parser.add_argument("--bucket-mib", type=_mib_list, default=[512, 256, 64])
    parser.add_argument("--reps", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.1,
        help="Python's thread switch interval: both loops share one interpreter here, where a "
        "trainer and a generator would not; the default 5 ms lets one side wait that long "
        "for the other's Python work",
    )
    parser.add_argument("--label", default="", help="names the tree measured (e.g. before, after)")
    parser.add_argument(
        "--profile", type=Path, help="write a chrome trace of one refit at the smallest bucket size here"
    )
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument(
        "--graphs-too",
        action="store_true",
        help="also measure the refit with CUDA graphs (needs an executor with the graphs option)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("loopback_bench.py needs a CUDA GPU")
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    setup = Setup(args.gib, torch.device("cuda"))
    result = {
        "label": args.label,
        "syncd": str(Path(syncd.__file__).parent),
        "reps": args.reps,
        "switch_interval_ms": args.switch_interval_ms,
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        **measure(setup, args.bucket_mib, args.reps, args.profile, args.graphs_too),
    }
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
