"""Change a running process's memory from outside it, as a failing DIMM or a stray write would:
through `/proc/PID/mem`, as root, with no hook in the process (tests of `syncctl verify`)."""

from __future__ import annotations

from pathlib import Path

_CHUNK = 1 << 24


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def flip_everywhere(pid: int, pattern: bytes) -> int:
    """Flip the lowest bit of the first byte of every copy of `pattern` in the writable memory of
    process `pid`; return how many copies changed (0 for a process that exited meanwhile)."""
    try:
        return _flip_in(pid, pattern)
    except (FileNotFoundError, ProcessLookupError):
        return 0


def count_everywhere(pid: int, pattern: bytes) -> int:
    """How many copies of `pattern` the writable memory of process `pid` holds (0 for a process
    that exited meanwhile)."""
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            return sum(len(_found(mem, start, end, pattern)) for start, end in _writable(pid))
    except (FileNotFoundError, ProcessLookupError):
        return 0


def _writable(pid: int) -> list[tuple[int, int]]:
    """[start, end) of every writable mapping of process `pid` that is memory."""
    spans = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            perms, name = fields[1], fields[5] if len(fields) > 5 else ""
            if not perms.startswith("rw") or name.startswith("[v"):  # [vvar], [vsyscall]: not memory
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    return spans


def _flip_in(pid: int, pattern: bytes) -> int:
    flipped = 0
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        for start, end in _writable(pid):
            for at in _found(mem, start, end, pattern):
                mem.seek(at)
                first = mem.read(1)
                mem.seek(at)
                mem.write(bytes([first[0] ^ 1]))
                flipped += 1
    return flipped


def _found(mem, start: int, end: int, pattern: bytes) -> list[int]:
    """Addresses of `pattern` in [start, end), read in chunks that overlap by the pattern's length."""
    hits = []
    at = start
    while at < end:
        mem.seek(at)
        try:
            data = mem.read(min(_CHUNK + len(pattern) - 1, end - at))
        except OSError:  # a mapping that cannot be read (a guard page, device memory)
            return hits
        i = data.find(pattern)
        while i != -1:
            hits.append(at + i)
            i = data.find(pattern, i + 1)
        at += _CHUNK
    return hits
