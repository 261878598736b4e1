"""Following a refit from a client (`syncctl watch`, `syncctl refit --wait`): syncd's server-sent
events (`GET /v1/refits/{id}/events`, `follow`) drawn as a terminal shows them (`view_for`):

- `RichView` on a terminal: one bar for the refit and one per receiving member (per stage when
  there are more than `MAX_MEMBER_BARS`), with bytes, rate and ETA, and the slowest link named;
- `PlainView` elsewhere: a line per update, at most one a second unless the state changed;
- `JsonView` (`--json`): each update's body, one JSON object a line.

A view only draws: what the watcher does when the refit ends, or on Ctrl-C (it stops watching,
never the refit), is its caller's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, TextIO

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TaskID, TextColumn
from rich.text import Text

from syncd.states import TERMINAL

MAX_MEMBER_BARS = 8
_RECONNECT_S = 0.5
_PLAIN_EVERY_S = 1.0

Body = Mapping[str, Any]  # GET /v1/refits/{id}: the refit with its `progress`


def follow(http: httpx.Client, refit_id: str, timeout_s: float) -> Iterator[Body]:
    """Each update of refit `refit_id` until it is COMMITTED or ABORTED (the last one yielded
    shows that), reconnecting when the stream breaks. Raises TimeoutError past `timeout_s`,
    httpx.HTTPStatusError when syncd refuses (an unknown refit: 404), httpx.TransportError when
    it cannot be reached before the first update."""
    deadline = time.monotonic() + timeout_s
    followed = False
    while True:
        try:
            for name, data in _events(http, f"/v1/refits/{refit_id}/events"):
                if name == "progress":
                    followed = True
                    body = json.loads(data)
                    yield body
                    if body["state"] in TERMINAL:
                        return
        except httpx.TransportError:
            if not followed:  # syncd is not there at all: say so at once
                raise
            # syncd restarted or the connection broke: follow on from what it says now
        if time.monotonic() > deadline:
            raise TimeoutError(f"{refit_id} did not finish within {timeout_s:g} s")
        time.sleep(_RECONNECT_S)


def _events(http: httpx.Client, path: str) -> Iterator[tuple[str, str]]:
    with http.stream("GET", path, timeout=httpx.Timeout(30.0)) as r:
        if r.status_code >= 400:
            r.read()
            r.raise_for_status()
        name, data = "message", list[str]()
        for line in r.iter_lines():
            if not line:
                if data:
                    yield name, "\n".join(data)
                name, data = "message", list[str]()
            elif line.startswith("event:"):
                name = line[len("event:") :].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:") :].strip())


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    s = round(s)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def slowest_text(p: Mapping[str, Any]) -> str:
    """`generator-1-0 <- generator-0-0 (relay), stage 0`: the link that ends last."""
    s = p.get("slowest")
    if not s:
        return ""
    via = " (relay)" if s["relay"] else ""
    return f"slowest {s['dst']} <- {s['src']}{via}, stage {s['stage']}, ETA {human_seconds(s['eta_s'])}"


def summary_line(body: Body) -> str:
    """One line of an update: state, bytes, rate, ETA, the slowest link."""
    p = body.get("progress")
    head = f"{body['id']}: {body['state']}"
    if not p or not p["bytes_total"]:
        return head
    eta = f"ETA {human_seconds(p['eta_s'])}" + (" (from past refits)" if p["eta_source"] == "model" else "")
    parts = [
        head,
        f"{100 * p['fraction']:5.1f}%",
        f"{human_bytes(p['bytes_done'])}/{human_bytes(p['bytes_total'])}",
        f"{human_bytes(p['rate_bytes_per_s'])}/s",
        eta,
    ]
    slowest = slowest_text(p)
    return "  ".join(parts + ([slowest] if slowest else []))


class View(Protocol):
    def update(self, body: Body) -> None: ...
    def close(self) -> None: ...


class JsonView:
    def __init__(self, out: TextIO) -> None:
        self._out = out

    def update(self, body: Body) -> None:
        print(json.dumps(body), file=self._out, flush=True)

    def close(self) -> None:
        pass


class PlainView:
    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._last_state: str | None = None
        self._last_at = 0.0

    def update(self, body: Body) -> None:
        now = time.monotonic()
        if body["state"] == self._last_state and now - self._last_at < _PLAIN_EVERY_S:
            return
        self._last_state, self._last_at = body["state"], now
        print(summary_line(body), file=self._out, flush=True)

    def close(self) -> None:
        pass


class RichView:
    """Live bars on a terminal; the last drawing stays on screen when it closes."""

    def __init__(self, console: Console) -> None:
        self._progress = Progress(
            TextColumn("{task.description}", justify="left"),
            BarColumn(bar_width=None),
            TextColumn("{task.percentage:>5.1f}%"),
            TextColumn("{task.fields[bytes]}"),
            TextColumn("{task.fields[rate]}"),
            TextColumn("ETA {task.fields[eta]}"),
            console=console,
            expand=True,
        )
        self._footer = Text()
        self._live = Live(Group(self._progress, self._footer), console=console, refresh_per_second=8)
        self._tasks: dict[str, TaskID] = {}
        self._live.start()

    def update(self, body: Body) -> None:
        p = body.get("progress")
        self._bar("refit", f"{body['id']} {body['state']}", p, p["eta_s"] if p else None)
        if p:
            rows = [(f"stage {s['stage']}", s) for s in p["stages"]]
            if len(p["members"]) <= MAX_MEMBER_BARS:
                rows = [(m["member_id"], m) for m in p["members"]]
            for name, share in rows:
                self._bar(name, f"  {name}", share, _eta(share))
        self._footer.plain = slowest_text(p) if p else ""

    def _bar(self, key: str, label: str, share: Mapping[str, Any] | None, eta: float | None) -> None:
        total = share["bytes_total"] if share and share["bytes_total"] else 1
        done = share["bytes_done"] if share else 0
        size = f"{human_bytes(done)}/{human_bytes(total)}" if share else ""
        rate = f"{human_bytes(share['rate_bytes_per_s'])}/s" if share else ""
        if key not in self._tasks:
            self._tasks[key] = self._progress.add_task(
                label, total=total, completed=done, bytes=size, rate=rate, eta=human_seconds(eta)
            )
        else:
            self._progress.update(
                self._tasks[key],
                description=label,
                total=total,
                completed=done,
                bytes=size,
                rate=rate,
                eta=human_seconds(eta),
            )

    def close(self) -> None:
        self._live.stop()


def _eta(share: Mapping[str, Any]) -> float | None:
    """Seconds left of a stage's or member's bytes at its rate now."""
    left = share["bytes_total"] - share["bytes_done"]
    if left <= 0:
        return 0.0
    return left / share["rate_bytes_per_s"] if share["rate_bytes_per_s"] > 0 else None


def view_for(out: TextIO, as_json: bool) -> View:
    """JSON lines, live bars on a terminal, or plain lines elsewhere."""
    if as_json:
        return JsonView(out)
    console = Console(file=out)
    return RichView(console) if console.is_terminal else PlainView(out)
