"""The README's GPU table, generated from the result files `bench/gpu_run.sh` writes.

    python -m bench.gpu_table            # print the table
    python -m bench.gpu_table --write    # put it into README.md between its markers
    python -m bench.gpu_table --check    # exit 1 when README.md's table is not this one

Reads bench/results/gpu/CARD-NGPU-BENCH-DATE.json, keeps the newest file of each card, GPU
count and benchmark, and writes one row per measure and file: the figure, the bound it is held
to, whether it holds, and whether the bytes were right (bit-exact, checksums agreeing) where
the benchmark checks them. Nothing in the table is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gpu"
README = ROOT / "README.md"
BEGIN, END = "<!-- gpu-table:begin (python -m bench.gpu_table --write) -->", "<!-- gpu-table:end -->"
_NAME = re.compile(
    r"^(?P<card>[a-z0-9]+)-(?P<gpus>\d+)gpu-(?P<bench>[a-z0-9-]+)-(?P<date>\d{4}-\d{2}-\d{2})\.json$"
)


@dataclass(frozen=True)
class Measure:
    bench: str
    what: str
    bound: float
    value: Callable[[dict[str, Any]], float]
    correct: Callable[[dict[str, Any]], bool | None]


def _sweep(mib: int) -> Callable[[dict[str, Any]], float]:
    return lambda r: next(w["refit_vs_raw"] for w in r["sweep"] if w["bucket_mib"] == mib)


MEASURES = [
    Measure(
        "landed",
        "landed check alone, of a device copy's speed",
        1.0,
        lambda r: r["check_over_d2d_speed"],
        lambda r: None,
    ),
    *(
        Measure(
            f"colocated-{g}gib",
            f"CUDA IPC refit, {g} GiB, of a device copy",
            0.7,
            lambda r: r["refit_over_d2d"],
            lambda r: bool(r["checksums"] and r["bit_exact"]),
        )
        for g in (4, 9)
    ),
    Measure(
        "fp8", "FP8 quantize-and-pack, of a device copy", 0.7, lambda r: r["pack_fp8_vs_d2d"], lambda r: None
    ),
    *(
        Measure(
            "refit",
            f"2-GPU refit with checksums, {mib} MiB buckets, of raw NCCL",
            bound,
            _sweep(mib),
            lambda r: bool(r["checksums_ok"]),
        )
        for mib, bound in ((512, 0.92), (256, 0.92), (64, 0.85))
    ),
    Measure(
        "stages",
        "pp=2 into tp=2, concurrent stages' speedup, of what their bytes allow",
        0.9,
        lambda r: r["stage_speedup_over_allowed"],
        lambda r: bool(r["bit_exact"] and r["checksums_ok"]),
    ),
    Measure(
        "stages",
        "pp=2 into tp=2 refit, of raw NCCL on every link at once",
        0.9,
        lambda r: r["refit_over_raw_planned_links"],
        lambda r: bool(r["bit_exact"] and r["checksums_ok"]),
    ),
]


def newest(results: Path = RESULTS) -> dict[tuple[str, int, str], tuple[str, Path]]:
    """(card, GPU count, benchmark) -> (date, file) of the newest result file."""
    found: dict[tuple[str, int, str], tuple[str, Path]] = {}
    for path in sorted(results.glob("*.json")):
        m = _NAME.match(path.name)
        if m is None:
            raise SystemExit(f"{path}: not named CARD-NGPU-BENCH-DATE.json (bench/gpu_run.sh names them so)")
        key = (m["card"], int(m["gpus"]), m["bench"])
        if key not in found or found[key][0] < m["date"]:
            found[key] = (m["date"], path)
    return found


def table(results: Path = RESULTS) -> str:
    files = newest(results)
    lines = [
        "| measure | card, GPUs | figure | bound | holds | bytes right | date | file |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in MEASURES:
        for (card, gpus, bench), (date, path) in sorted(files.items()):
            if bench != m.bench:
                continue
            r = json.loads(path.read_text())
            value, correct = m.value(r), m.correct(r)
            holds = "yes" if value >= m.bound else "**no**"
            right = {None: "-", True: "yes", False: "**no**"}[correct]
            link = path.relative_to(ROOT).as_posix()
            lines.append(
                f"| {m.what} | {card.upper()} x{gpus} | {value:.2f} | >= {m.bound:g} | {holds} | {right} "
                f"| {date} | [{path.name}]({link}) |"
            )
    return "\n".join(lines)


def with_table(readme: str, generated: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} markers")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{generated}\n{END}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="write the table into README.md")
    group.add_argument("--check", action="store_true", help="exit 1 when README.md's table differs")
    args = parser.parse_args()
    generated = table()
    if not (args.write or args.check):
        print(generated)
        return
    readme = README.read_text()
    updated = with_table(readme, generated)
    if args.check:
        sys.exit(0 if updated == readme else 1)
    README.write_text(updated)


if __name__ == "__main__":
    main()
