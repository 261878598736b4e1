"""Suite-wide settings: tiers by folder, GPU tests skip without GPUs, and no test starts vLLM
without saying so.

Tiers (tests/README.md): every test gets the markers of its folder here, so none can be
forgotten; `make test-fast` deselects every test that carries one of `SLOW_MARKERS`.
"""

from __future__ import annotations

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


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in FOLDER_MARKERS[_folder(item)]:
            item.add_marker(name)
    if config.pluginmanager.hasplugin("xdist"):
        _group_for_workers(items)
    gpus = _gpu_count()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = max((m.kwargs.get("count", 1) for m in item.iter_markers("gpu")), default=1)
        if gpus < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} GPU(s), found {gpus}"))


# -- running on several workers (pytest-xdist, `--dist loadgroup`) --------------------------------
# A module's tests stay together on one worker (its module fixtures start once). The lab's tests
# share one worker: they create namespaces, a bridge and a SLURM cluster of fixed names. The
# generator modules that use the session's shared engines share one worker, so the engines start
# once. The slowest groups go first, so no long group starts last and runs alone.
LAB_FILES = ("e2e/test_lab_e2e.py",)
FIRST = ("lab", "e2e", "generator", "trainer", "integration", "dtensor")


def _group_for_workers(items: list[pytest.Item]) -> None:
    def group(item: pytest.Item) -> str:
        path = Path(str(item.fspath)).resolve().relative_to(TESTS).as_posix()
        if _folder(item) == "lab" or path in LAB_FILES:
            return "lab"
        if "_launched" in getattr(item, "fixturenames", ()):
            return "generator-shared-engines"
        return path

    def rank(item: pytest.Item) -> int:
        name = "lab" if group(item) == "lab" else _folder(item)
        return FIRST.index(name) if name in FIRST else len(FIRST)

    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
    items.sort(key=rank)  # stable: within a rank, the collection order


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
