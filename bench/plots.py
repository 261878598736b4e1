"""The benchmark results as figures for the docs: `python -m bench.plots` reads every JSON file
under bench/results (sub-folders included) and writes PNGs into docs/figures:

- fanout.png: refit time and trainer egress against generator replicas (`bench/fanout_bench.py`);
- delta-vs-full.png: delta refits (an RL-like step, everything changed) against full ones, from
  the same runs;
- gpu-refit-vs-nccl.png: GPU refit bandwidth against raw NCCL by bucket size, one colour per card
  (`bench/refit_bench.py --backend nccl` summaries, and runs files that name their command);
- colocated-vs-copy.png: a refit between colocated members against a plain memory copy on the
  same device (`bench/colocated_bench.py`).

A result file is recognised by the fields it carries, not by its name, so new runs join the
figures as they are added; a figure with no results is skipped, saying so. Each figure written is
printed with what it shows (runs, cards, bucket sizes). The PNGs are small
(about 100 dpi, few colours) so that the repository stays light.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
FIGURES = REPO / "docs" / "figures"
DPI = 100
GIB = 1 << 30

Result = dict[str, Any]


@dataclass(frozen=True)
class Loaded:
    path: Path
    body: Result


def load_results(folder: Path) -> list[Loaded]:
    """Every JSON object under `folder`, with its path (files that are not one are skipped)."""
    out = []
    for path in sorted(folder.rglob("*.json")):
        try:
            body = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(body, dict):
            out.append(Loaded(path, body))
    return out


def _card(device: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `H100`; `2x NVIDIA H200 (one host)` -> `H200`."""
    m = re.search(r"\b([A-Z]\d{2,4}[A-Za-z]*)\b", device)
    return m.group(1) if m else device


# ---- fan-out and delta (bench/fanout_bench.py) ----


def _fanout_rows(results: list[Loaded]) -> Iterator[tuple[Loaded, list[Result]]]:
    for r in results:
        rows = r.body.get("rows")
        if isinstance(rows, list) and rows and {"replicas", "step", "refit_s"} <= set(rows[0]):
            yield r, rows


def fanout_figure(results: list[Loaded]) -> Figure | None:
    # a run of one replica count (progress reports on and off) says nothing about growth
    runs = [(r, rows) for r, rows in _fanout_rows(results) if len({row["replicas"] for row in rows}) > 1]
    if not runs:
        return None
    fig, (time_ax, egress_ax) = plt.subplots(1, 2, figsize=(7.5, 3.0))
    for r, rows in runs:
        full = sorted((row for row in rows if row["step"] == "full"), key=lambda row: row["replicas"])
        replicas = [row["replicas"] for row in full]
        label = f"{r.body.get('link_gbit', '?')} Gbit/s links, {r.body.get('date', '')[:10]}"
        time_ax.plot(replicas, [row["refit_s"] for row in full], "o-", label=label)
        egress_ax.plot(replicas, [row["trainer_egress_bytes"] / GIB for row in full], "o-", label=label)
        model = r.body.get("model_bytes")
        if model:
            n = max(replicas)
            egress_ax.plot(
                [1, n], [model / GIB, n * model / GIB], ":", color="grey", label="no fan-out (x replicas)"
            )
    time_ax.set(xlabel="generator replicas", ylabel="refit time (s)", title="Refit time", ylim=(0, None))
    egress_ax.set(xlabel="generator replicas", ylabel="GiB", title="Trainer egress per refit", ylim=(0, None))
    egress_ax.legend(fontsize=7)
    for ax in (time_ax, egress_ax):
        _powers_of_two(ax, sorted({row["replicas"] for _, rows in runs for row in rows}))
    fig.suptitle("Fan-out: replicas relay, the trainer sends one copy", fontsize=10)
    fig.set_label(
        f"{len(runs)} run(s), replicas {_listed({row['replicas'] for _, rows in runs for row in rows})}"
    )
    return fig


def delta_figure(results: list[Loaded]) -> Figure | None:
    runs = [(r, rows) for r, rows in _fanout_rows(results) if any(row["step"] == "rl-like" for row in rows)]
    if not runs:
        return None
    _, rows = runs[-1]  # the newest file by name (dated names)
    by_step: dict[str, dict[int, float]] = defaultdict(dict)
    for row in rows:
        by_step[row["step"]][row["replicas"]] = row["refit_s"]
    replicas = sorted(by_step["full"])
    labels = {
        "full": "full",
        "rl-like": "delta, RL-like step",
        "everything": "delta, everything changed",
    }
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    width = 0.8 / len(labels)
    for i, (step, label) in enumerate(labels.items()):
        xs = [k + (i - 1) * width for k in range(len(replicas))]
        ax.bar(xs, [by_step[step].get(n, 0.0) for n in replicas], width, label=label)
    ax.set_xticks(range(len(replicas)), [str(n) for n in replicas])
    ax.set(xlabel="generator replicas", ylabel="refit time (s)", title="Delta refits against full refits")
    ax.set_ylim(0, 1.3 * max(max(steps.values(), default=0.0) for steps in by_step.values()))
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.set_label(f"replicas {_listed(replicas)}")
    return fig


def _listed(values) -> str:
    return ", ".join(str(v) for v in sorted(values))


def _powers_of_two(ax: Axes, ticks: list[int]) -> None:
    """A log-2 x axis labelled with the values themselves (1, 2, 4, 8), not 2^n."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    if len(ticks) == 1:
        ax.set_xlim(ticks[0] / 2, ticks[0] * 2)
    ax.grid(alpha=0.3)


# ---- GPU refit against raw NCCL (bench/refit_bench.py) ----


@dataclass(frozen=True)
class GpuPoint:
    card: str
    bucket_mib: int
    refit_gbps: float
    raw_gbps: float


def gpu_points(results: list[Loaded]) -> list[GpuPoint]:
    points = []
    for r in results:
        b = r.body
        if b.get("backend") == "nccl" and "raw_gbps" in b and "refit_gbps" in b:
            card = _card(str(b.get("device", "GPU")))
            sweep = b.get("sweep") or [{"bucket_mib": b.get("bucket_mib", 0), "refit_gbps": b["refit_gbps"]}]
            points += [GpuPoint(card, int(s["bucket_mib"]), s["refit_gbps"], b["raw_gbps"]) for s in sweep]
        elif "--backend nccl" in str(b.get("command", "")) and isinstance(b.get("runs"), dict):
            points += _runs_points(b)
    return [p for p in points if p.bucket_mib > 0]


def _runs_points(b: Result) -> list[GpuPoint]:
    """A file of several runs of one command: runs named `after*` (the code as it now is) when
    there are any, else all; their medians."""
    m = re.search(r"--bucket-mib (\d+)", str(b["command"]))
    if m is None:
        return []
    runs = b["runs"]
    chosen = [v for k, v in runs.items() if k.startswith("after")] or list(runs.values())
    refit = statistics.median(v["refit_gbps"] for v in chosen)
    raw = statistics.median(v["raw_gbps"] for v in chosen)
    return [GpuPoint(_card(str(b.get("device", "GPU"))), int(m.group(1)), refit, raw)]


def gpu_figure(results: list[Loaded]) -> Figure | None:
    points = gpu_points(results)
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    cards = sorted({p.card for p in points})
    shown = []
    for i, card in enumerate(cards):
        color = f"C{i}"
        mine = sorted((p for p in points if p.card == card), key=lambda p: p.bucket_mib)
        by_bucket: dict[int, list[float]] = defaultdict(list)
        for p in mine:
            by_bucket[p.bucket_mib].append(p.refit_gbps)
        buckets = sorted(by_bucket)
        ax.plot(buckets, [max(by_bucket[k]) for k in buckets], "o-", color=color, label=f"{card}: refit")
        raw = statistics.median(p.raw_gbps for p in mine)
        ax.axhline(raw, color=color, linestyle="--", linewidth=1, label=f"{card}: raw NCCL")
        shown.append(f"{card} at {_listed(buckets)} MiB")
    _powers_of_two(ax, sorted({p.bucket_mib for p in points}))
    ax.set(xlabel="bucket size (MiB)", ylabel="GB/s", title="GPU refit against raw NCCL, two GPUs")
    ax.set_ylim(0, 1.25 * max(max(p.raw_gbps, p.refit_gbps) for p in points))
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    fig.set_label("; ".join(shown))
    return fig


# ---- colocated against a memory copy (bench/colocated_bench.py) ----


def colocated_figure(results: list[Loaded]) -> Figure | None:
    bars: list[tuple[str, float, float]] = []  # (device, memory copy, refit)
    for r in results:
        b = r.body
        copy = b.get("memcpy_gbps", b.get("d2d_gbps"))
        if copy is None or "refit_gbps" not in b or "rows" in b:
            continue
        device = _card(str(b["gpu"])) if b.get("gpu") else f"CPU ({b.get('cpus', '?')} cores)"
        if "bytes" in b:  # the model's size tells runs of one device apart
            device += f", {b['bytes'] / 1e9:.1f} GB"
        bars.append((device, copy, b["refit_gbps"]))
    if not bars:
        return None
    # One panel per device and size: the last result file of each (the files come sorted by name,
    # which ends in the date where the name has one).
    bars = list({device: (device, copy, refit) for device, copy, refit in bars}.values())
    fig, axes = plt.subplots(1, len(bars), figsize=(3.2 * len(bars), 3.3), squeeze=False)
    for ax, (device, copy, refit) in zip(axes[0], bars):
        ax.bar(["memory copy", "refit"], [copy, refit], color=["grey", "C0"])
        ax.set(title=f"{device}\nrefit = {refit / copy:.2f} x copy", ylabel="GB/s")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Colocated refit (same host or GPU) against a memory copy", fontsize=10)
    fig.set_label(", ".join(device for device, _, _ in bars))
    return fig


FIGURES_BY_NAME: dict[str, Callable[[list[Loaded]], Figure | None]] = {
    "fanout.png": fanout_figure,
    "delta-vs-full.png": delta_figure,
    "gpu-refit-vs-nccl.png": gpu_figure,
    "colocated-vs-copy.png": colocated_figure,
}


def render(results_dir: Path, out_dir: Path) -> list[Path]:
    """Write every figure that has results; returns the files written."""
    results = load_results(results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make in FIGURES_BY_NAME.items():
        fig = make(results)
        if fig is None:
            print(f"{name}: no results for it under {results_dir}; skipped")
            continue
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=DPI, metadata={"Software": None}, pil_kwargs={"optimize": True})
        plt.close(fig)
        written.append(path)
        print(f"{name}: {path.stat().st_size // 1024} KiB: {fig.get_label()}")
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="folder of result files (searched deep)")
    p.add_argument("--out", type=Path, default=FIGURES, help="where the PNGs go")
    args = p.parse_args()
    render(args.results, args.out)


if __name__ == "__main__":
    main()
