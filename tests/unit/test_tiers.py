"""The tiers hold: every folder has one, a test that starts a vLLM engine without the `vllm`
marker fails (tests/conftest.py), so the fast tier cannot grow an engine unnoticed, and a run
by marker leaves the folders it cannot select uncollected."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FOLDER_MARKERS, _selects_nothing, group_of

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


FAST = "not (processes or vllm or e2e or lab or gpu)"  # the Makefile's


def test_the_fast_tier_imports_no_module_of_a_slow_folder(pytester: pytest.Pytester) -> None:
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.mkdir("unit").joinpath("test_fast.py").write_text(
        "import pytest\n\ndef test_fast():\n    pass\n\n@pytest.mark.lab\ndef test_marked_slow():\n    pass\n"
    )
    pytester.mkdir("e2e").joinpath("test_slow.py").write_text("raise ImportError('collected')\n")
    fast = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-m", FAST)
    fast.assert_outcomes(passed=1, deselected=1)
    slow = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-m", f"not ({FAST})")
    slow.assert_outcomes(errors=1)  # the slow tier does import it
    slow.stdout.fnmatch_lines(["*ImportError: collected*"])


@pytest.mark.parametrize(
    ("markexpr", "folder", "nothing"),
    [
        (FAST, "e2e", True),
        (FAST, "unit", False),
        (f"not ({FAST})", "unit", False),  # a test there may carry a slow marker itself
        ("vllm and not e2e", "e2e", True),
        ("vllm and not e2e", "generator", False),
        ("gpu", "unit", False),
        ("not processes or gpu", "trainer", False),  # a trainer test marked gpu
        ("not gpu(count=2)", "gpu", False),  # a GPU test of one GPU
    ],
)
def test_a_folder_is_left_out_only_when_no_markers_could_select_its_tests(
    markexpr: str, folder: str, nothing: bool
) -> None:
    assert _selects_nothing(markexpr, folder) is nothing


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
