"""`python -m bench.plots`, run as a user runs it (the tests import no benchmark), draws the
figures of the docs from the result files: every figure the repository's results allow, small; a
results folder with fewer kinds of files gives fewer figures, and a GPU summary dropped into a
sub-folder joins the GPU figure as a card of its own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
FIGURES = ["colocated-vs-copy.png", "delta-vs-full.png", "fanout.png", "gpu-refit-vs-nccl.png"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _plots(results: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.plots", "--results", str(results), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )


def test_every_figure_from_the_repositorys_results_is_a_small_png(tmp_path: Path) -> None:
    _plots(RESULTS, tmp_path)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == FIGURES
    for png in tmp_path.iterdir():
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size < 100 << 10, png.name


def test_fewer_results_fewer_figures_and_new_cards_join(tmp_path: Path) -> None:
    results = tmp_path / "results"
    (results / "gpu").mkdir(parents=True)
    shutil.copy(RESULTS / "fanout-delta-lab-2026-11-27-final.json", results)
    summary = {
        "backend": "nccl",
        "device": "NVIDIA H100 80GB HBM3",
        "raw_gbps": 300.0,
        "refit_gbps": 200.0,
        "bucket_mib": 64,
        "sweep": [{"bucket_mib": 64, "refit_gbps": 200.0}, {"bucket_mib": 256, "refit_gbps": 250.0}],
    }
    (results / "gpu" / "h100.json").write_text(json.dumps(summary))
    shown = _plots(results, tmp_path / "figures").stdout
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == [
        "delta-vs-full.png",
        "fanout.png",
        "gpu-refit-vs-nccl.png",
    ]
    assert "colocated-vs-copy.png: no results" in shown
    assert "gpu-refit-vs-nccl.png" in shown and "H100 at 64, 256 MiB" in shown
