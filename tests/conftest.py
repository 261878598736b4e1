"""Suite-wide settings: tiers by folder, GPU tests skip without GPUs, and no test starts vLLM
without saying so.

Tiers (tests/README.md): every test gets the markers of its folder here, so none can be
forgotten; `make test-fast` deselects every test that carries one of `SLOW_MARKERS`.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# The markers of each folder's tests; the fast tier's folders have none (pure functions,
# one-process components, a real syncd in-process with simulated members). A test in a folder
# named nowhere here stops the run: its tier is a decision, not a default.
FOLDER_MARKERS: dict[str, tuple[str, ...]] = {
    "unit": (),
    "control": (),
    "deploy": (),
    "trainer": ("processes",),
    "dtensor": ("processes",),
    "integration": ("processes",),
    "generator": ("vllm",),
    "e2e": ("e2e", "vllm", "processes"),
    "lab": ("lab", "processes"),
    "gpu": ("gpu",),
}
# What `make test-fast` leaves out: any of these markers puts a test in the slow tier.
SLOW_MARKERS = ("processes", "vllm", "e2e", "lab", "gpu")


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - whatever breaks torch's CUDA probe means no usable GPU: gpu tests skip
        return 0


def _folder(item: pytest.Item) -> str:
    folder = Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0]
    if folder not in FOLDER_MARKERS:
        raise pytest.UsageError(
            f"{item.nodeid}: tests/{folder} has no tier; add it to FOLDER_MARKERS in tests/conftest.py"
        )
    return folder


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave a folder uncollected when `-m` selects none of its tests, whatever markers a test
    adds to its folder's: `make test-fast` then imports no module of the slow folders (they import
    vLLM, about 7 s of CPU in every pytest-xdist worker)."""
    markexpr = config.getoption("markexpr", "")
    if markexpr and collection_path.parent == TESTS and collection_path.name in FOLDER_MARKERS:
        return _selects_nothing(markexpr, collection_path.name) or None
    return None


@functools.cache
def _selects_nothing(markexpr: str, folder: str) -> bool:
    """Whether `markexpr` is false for every set of markers that holds the folder's: every other
    marker it names is tried present and absent (a handful, so every combination)."""
    from _pytest.mark.expression import Expression

    # A marker's arguments (`-m "gpu(count=2)"`) the folders do not decide: any test may match.
    if re.search(r"\b(?!(?:and|or|not)\b)\w+\s*\(", markexpr):
        return False
    expression = Expression.compile(markexpr)
    fixed = set(FOLDER_MARKERS[folder])
    free = sorted(expression.idents() - fixed)
    for present in itertools.product((False, True), repeat=len(free)):
        markers = fixed | {name for name, on in zip(free, present) if on}
        if expression.evaluate(functools.partial(_carries, markers)):
            return False
    return True


def _carries(markers: set[str], name: str, /, **kwargs: object) -> bool:
    return name in markers


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in FOLDER_MARKERS[_folder(item)]:
            item.add_marker(name)
    _slowest_first(items)
    gpus = _gpu_count()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = max((m.kwargs.get("count", 1) for m in item.iter_markers("gpu")), default=1)
        if gpus < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} GPU(s), found {gpus}"))


# -- running on several workers (pytest-xdist, `--dist loadgroup`) --------------------------------
# A worker takes a whole group at a time: a module's tests stay together (its module fixtures start
# once); the lab's tests share one group (namespaces, a bridge and a SLURM cluster of fixed
# names); the generator modules that use the session's shared engines share one, so the engines
# start once. Groups are named from the test's file alone, because the scheduler runs in the
# controller, which collects nothing. The slowest groups go first, so none starts last alone.
LAB_FILES = ("tests/e2e/test_lab_e2e.py",)
SHARED_ENGINES = re.compile(r"\b(_launched|service_a|outputs_a|outputs_fresh_b)\b")
FIRST = ("lab", "e2e", "generator", "trainer", "integration", "dtensor")


@functools.cache
def _uses_shared_engines(path: str) -> bool:
    return bool(SHARED_ENGINES.search((TESTS.parent / path).read_text()))


def group_of(nodeid: str) -> str:
    """The group a test runs in on the workers: its file, or one of the shared groups above."""
    path = nodeid.split("::", 1)[0]  # relative to the repository's root: tests/FOLDER/FILE
    parts = Path(path).parts
    folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
    if folder == "lab" or path in LAB_FILES:
        return "lab"
    if folder == "generator" and _uses_shared_engines(path):
        return "generator-shared-engines"
    return path


def _slowest_first(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        group = group_of(item.nodeid)
        name = group if group == "lab" else _folder(item)
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: within a rank, the collection order


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; without it, never called
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    # pytest-xdist 3.8's own loadgroup marks a group by editing `item._nodeid`, which pytest 9
    # no longer reads; a scope scheduler that asks `group_of` does the same job.
    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)


def pytest_configure(config):
    _spread_engines_over_cores()
    # The CPU each test file took (tests/cpu_accounting.py), counted where the tests run: not in
    # pytest-xdist's controller (its processes are the workers, whose CPU they count themselves),
    # nor in a session of pytest run by a test on a copy of this file elsewhere
    # (tests/unit/test_tiers.py), where `tests` is no package.
    controller = bool(config.getoption("numprocesses", None)) and "PYTEST_XDIST_WORKER" not in os.environ
    if os.environ.get("TEST_CPU_REPORT") and config.rootpath == TESTS.parent and not controller:
        from tests.cpu_accounting import CpuAccounting

        config.pluginmanager.register(CpuAccounting(Path(os.environ["TEST_CPU_REPORT"])), "cpu-accounting")


def _spread_engines_over_cores() -> None:
    """vLLM on CPU binds an engine's worker to one core, core 0 unless told
    (`VLLM_CPU_OMP_THREADS_BIND`): the engines of every pytest-xdist worker would share core 0 while
    the others idle. Each worker's engines get a core of their own (worker N: core N modulo the
    cores); a test that sets the binding itself (TP 2, the lab's replicas) keeps its own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...; unset without workers
    if worker.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(int(worker[2:]) % (os.cpu_count() or 1))


# -- no vLLM engine without the `vllm` marker ------------------------------------------------------
# An engine is expensive (~20 s to start here); a test that starts one must say so, or it would
# land in the fast tier. vLLM names its engine process `VLLM::EngineCore` (setproctitle) and its
# workers `VLLM::Worker...`; generator_svc runs as `python -m generator_svc`.


def _engine_processes() -> set[int]:
    import psutil

    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            name = child.name()
            cmdline = " ".join(child.cmdline())
        except psutil.Error:  # gone, or a zombie: not an engine that runs
            continue
        if name.startswith("VLLM") or "generator_svc" in cmdline or "vllm.entrypoints" in cmdline:
            found.add(child.pid)
    return found


_seen_engines: set[int] = set()


def _check_engines(item: pytest.Item, phase: str) -> None:
    new = _engine_processes() - _seen_engines
    _seen_engines.update(new)
    if new and item.get_closest_marker("vllm") is None:
        pytest.fail(
            f"{item.nodeid} started a vLLM engine (pids {sorted(new)}) during {phase} without the "
            "`vllm` marker: mark it, or move it to a folder whose tests carry it (tests/conftest.py)",
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    result = yield
    _check_engines(item, "setup")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    _check_engines(item, "the test")
    return result
