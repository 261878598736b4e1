"""The README's GPU table is the one `python -m bench.gpu_table` generates from the result files
(run as users run it: tests import no benchmark code)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gpu_table(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_table", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_the_readmes_gpu_table_is_generated_from_the_result_files():
    assert _gpu_table("--check").returncode == 0, "run: python -m bench.gpu_table --write"


def test_every_newest_result_file_is_in_the_table():
    printed = _gpu_table()
    assert printed.returncode == 0, printed.stderr
    files = sorted((ROOT / "bench" / "results" / "gpu").glob("*.json"))
    assert files, "bench/results/gpu holds result files"
    newest: dict[str, str] = {}
    for f in files:  # CARD-NGPU-BENCH-DATE.json: the newest date of each CARD-NGPU-BENCH
        kind, date = f.stem[:-11], f.stem[-10:]
        newest[kind] = max(newest.get(kind, ""), date)
    for kind, date in newest.items():
        assert f"{kind}-{date}.json" in printed.stdout, kind
