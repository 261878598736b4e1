"""The tiers hold: every folder has one, and a test that starts a vLLM engine without the `vllm`
marker fails (tests/conftest.py), so the fast tier cannot grow an engine unnoticed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FOLDER_MARKERS, group_of

pytest_plugins = ("pytester",)

TESTS = Path(__file__).resolve().parents[1]

# A stand-in for an engine: the check knows `python -m generator_svc` by its command line.
ENGINE_TESTS = """
import subprocess, sys, time
import pytest

@pytest.fixture
def started():
    procs = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()

def _start(started):
    started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "generator_svc"]))
    time.sleep(0.2)

def test_unmarked(started):
    _start(started)

@pytest.mark.vllm
def test_marked(started):
    _start(started)
"""


def test_every_folder_of_tests_has_a_tier() -> None:
    folders = {p.parent.relative_to(TESTS).parts[0] for p in TESTS.rglob("test_*.py")}
    assert folders <= set(FOLDER_MARKERS), sorted(folders - set(FOLDER_MARKERS))


def test_a_test_that_starts_an_engine_without_the_vllm_marker_fails(pytester: pytest.Pytester) -> None:
    unit = pytester.mkdir("unit")  # a fast-tier folder: no marker comes from it
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    (unit / "test_engines.py").write_text(ENGINE_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_unmarked started a vLLM engine*without the `vllm` marker*"])


@pytest.mark.parametrize(
    ("nodeid", "group"),
    [
        ("tests/lab/test_lab.py::test_x", "lab"),
        ("tests/e2e/test_lab_e2e.py::test_x[a]", "lab"),
        ("tests/generator/test_request_guard.py::test_x", "generator-shared-engines"),
        ("tests/generator/test_pause_modes.py::test_x", "tests/generator/test_pause_modes.py"),
        ("tests/e2e/test_refit_e2e.py::test_x", "tests/e2e/test_refit_e2e.py"),
    ],
)
def test_workers_take_whole_groups(nodeid: str, group: str) -> None:
    assert group_of(nodeid) == group
