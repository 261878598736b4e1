"""Where the suite's CPU goes, by test file: `TEST_CPU_REPORT=DIR make test` (tests/conftest.py
registers `CpuAccounting` then) writes one JSON file per pytest process (each xdist worker) into
DIR, and `python -m tests.cpu_accounting DIR` sums them into a table by file (`--by-test`: by test).

On a 2-core machine the slow tier keeps both cores busy, so its wall time follows its CPU time,
not its waits; this is what says which files to make cheaper. A test's CPU is what the pytest
process and every process under it used between the end of the test before and its own end: the
pytest process's own, the processes it reaped (`RUSAGE_CHILDREN`), and each live descendant's
with what it reaped itself; a module's fixtures' teardown counts in its last test. A process whose
parent died before it (re-parented away from the tree) is not counted once it ends: the figures
are a floor.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from collections import defaultdict
from pathlib import Path

import pytest


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime + _live_descendants_s()


def _live_descendants_s() -> float:
    """The CPU of every live process under this one, each with the children it reaped: when one
    ends, its parent's reaped share (or ours) takes it over, so the total does not jump."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:  # ended meanwhile: its parent's reaped share has it, or soon will
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


class CpuAccounting:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.by_test: dict[str, float] = defaultdict(float)
        self.last = _cpu_s()

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(self, nodeid: str, location) -> None:
        now = _cpu_s()
        self.by_test[nodeid] += now - self.last
        self.last = now

    def pytest_sessionfinish(self) -> None:
        self.by_test["(session fixtures' teardown)"] += _cpu_s() - self.last
        self.folder.mkdir(parents=True, exist_ok=True)
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (self.folder / f"cpu-{name}-{os.getpid()}.json").write_text(json.dumps(self.by_test, indent=1))


def main(folder: str, by_test: bool = False) -> None:
    total: dict[str, float] = defaultdict(float)
    for path in Path(folder).glob("cpu-*.json"):
        for nodeid, seconds in json.loads(path.read_text()).items():
            total[nodeid if by_test else nodeid.split("::", 1)[0]] += seconds
    whole = sum(total.values())
    print(f"{'CPU s':>8} {'share':>6}  {'test' if by_test else 'test file'} (total {whole:.0f} s)")
    for file, seconds in sorted(total.items(), key=lambda kv: -kv[1]):
        try:
            print(f"{seconds:8.0f} {seconds / whole:6.1%}  {file}")
        except BrokenPipeError:  # | head
            return


if __name__ == "__main__":
    main(sys.argv[1], by_test="--by-test" in sys.argv[2:])
