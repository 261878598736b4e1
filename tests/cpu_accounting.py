"""Where the suite's CPU goes, by test file: `TEST_CPU_REPORT=DIR make test` writes one JSON file
per pytest process (each xdist worker) into DIR, and `python -m tests.cpu_accounting DIR` sums
them into a table.

On a 2-core machine the slow tier keeps both cores busy, so its wall time follows its CPU time,
not its waits; this is what says which files to make cheaper. A test's CPU is the pytest
process's own plus that of the processes it started and reaped (engines, trainer jobs, syncd),
counted when each test ends, with its module's fixtures' teardown in its last test. A process
killed without being reaped by its parent (an engine's worker when the engine is killed) is
not counted: the figures are a floor.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ENV = "TEST_CPU_REPORT"


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


class CpuAccounting:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.by_file: dict[str, float] = defaultdict(float)
        self.last = _cpu_s()

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(self, nodeid: str, location) -> None:
        now = _cpu_s()
        self.by_file[nodeid.split("::", 1)[0]] += now - self.last
        self.last = now

    def pytest_sessionfinish(self) -> None:
        self.by_file["(session fixtures' teardown)"] += _cpu_s() - self.last
        self.folder.mkdir(parents=True, exist_ok=True)
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (self.folder / f"cpu-{name}-{os.getpid()}.json").write_text(json.dumps(self.by_file, indent=1))


def pytest_configure(config: pytest.Config) -> None:
    folder = os.environ.get(ENV)
    if folder:
        config.pluginmanager.register(CpuAccounting(Path(folder)), "cpu-accounting")


def main(folder: str) -> None:
    total: dict[str, float] = defaultdict(float)
    for path in Path(folder).glob("cpu-*.json"):
        for file, seconds in json.loads(path.read_text()).items():
            total[file] += seconds
    whole = sum(total.values())
    print(f"{'CPU s':>8} {'share':>6}  test file (total {whole:.0f} s)")
    for file, seconds in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"{seconds:8.0f} {seconds / whole:6.1%}  {file}")


if __name__ == "__main__":
    main(sys.argv[1])
