"""Where a command's CPU goes, by kind of process: `python -m tests.cpu_by_process -- make test`.

`tests.cpu_accounting` says which test files cost most; this says what inside them does: vLLM's
engine processes, trainer ranks, syncd, the pytest workers. It runs the command and samples every
process under it twice a second (psutil), keeping each one's last CPU time, then prints the table
and exits with the command's status. A process that ends loses what it used since its last
sample, and one shorter than a sample is missed, so the figures are a floor.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import defaultdict

import psutil

# First match wins: a kind's pattern, searched in the process's command line (or its name).
KINDS = [
    ("vLLM engine core", r"VLLM::EngineCore"),
    ("vLLM worker", r"VLLM::Worker"),
    ("vLLM process (spawned)", r"multiprocessing\.spawn"),
    ("generator_svc API server", r"-m generator_svc\b"),
    ("vllm serve API server", r"vllm\.entrypoints\.openai\.api_server"),
    ("torchrun agent", r"torch\.distributed\.run"),
    ("trainer rank", r"trainer_svc|--rank-job"),
    ("syncd", r"-m syncd\b"),
    ("pytest", r"pytest|execnet|exec\(eval\(sys\.stdin"),
    ("demo driver", r"deploy\.local\.demo"),
]
SAMPLE_S = 0.5


def kind_of(command: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, command)), "other")


def sample(root: psutil.Process, seen: dict[tuple[int, float], list]) -> None:
    try:
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:  # the command ended meanwhile
        return
    for p in processes:
        try:
            with p.oneshot():
                key = (p.pid, p.create_time())
                t = p.cpu_times()
                # The latest command line: vLLM retitles its spawned processes once they run.
                command = f"{p.name()} {' '.join(p.cmdline())}"
        except psutil.Error:  # ended meanwhile
            continue
        seen[key] = [command, t.user + t.system]


def table(seen: dict[tuple[int, float], list]) -> str:
    cpu: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for command, seconds in seen.values():
        kind = kind_of(command)
        cpu[kind] += seconds
        count[kind] += 1
    total = sum(cpu.values()) or 1.0
    lines = [f"{'CPU s':>8} {'share':>6} {'procs':>6} {'each':>6}  kind (total {total:.0f} s)"]
    for kind in sorted(cpu, key=cpu.__getitem__, reverse=True):
        each = cpu[kind] / count[kind]
        lines.append(f"{cpu[kind]:8.0f} {cpu[kind] / total:6.1%} {count[kind]:6d} {each:6.1f}  {kind}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    child = subprocess.Popen(command)
    root = psutil.Process(child.pid)
    seen: dict[tuple[int, float], list] = {}
    while child.poll() is None:
        sample(root, seen)
        time.sleep(SAMPLE_S)
    print(table(seen), file=sys.stderr)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
