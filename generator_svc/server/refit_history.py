"""The serving side of this generator's refits: how long each held requests, and how many requests
spanned it (`GET /v1/install`'s `history`, and the metrics)."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

from generator_svc.server import metrics
from generator_svc.server.token_versions import Span
from generator_svc.settings import PauseMode


@dataclass
class RefitPause:
    """One committed install as the requests saw it: requests were held `pause_s` (from when the
    pause held them to the resume, `UpdateLifecycle.pause`), of which `install_s` from the pause
    call's return to the resume call (the install); the pause call itself took `pause_call_s`
    (`keep`, `abort`: the engine step in flight finishing; `wait`: the running requests finishing).
    `spanning_requests` finished requests have tokens from before and from `version` (counted as
    they finish, so it grows after the install)."""

    version: str
    pause_mode: PauseMode
    pause_s: float
    install_s: float
    pause_call_s: float
    spanning_requests: int = 0


class RefitHistory:
    """The last `keep` installs, oldest first."""

    def __init__(self, keep: int = 100) -> None:
        self._entries: deque[RefitPause] = deque(maxlen=keep)

    def add(self, entry: RefitPause) -> None:
        self._entries.append(entry)

    def finished(self, spans: list[Span]) -> None:
        """A request finished with these spans: each version it switched to gains a spanning
        request (the latest install of that label)."""
        for switch in spans[1:]:
            metrics.SPANNING_REQUESTS.inc()
            for entry in reversed(self._entries):
                if entry.version == switch.version:
                    entry.spanning_requests += 1
                    break

    def entries(self) -> list[dict]:
        return [asdict(e) for e in self._entries]
