"""The progress of one refit's transfer (`TransferProgress`), from its receiving members'
progress reports (`ProgressReport`, a few a second each) and their TRANSFERRED reports, and what
the API shows of it (`RefitProgress`).

Bytes count per link (stage, src, dst) of the plan, relays' links included: the bytes on the wire
(a delta link counts its buckets whole as they arrive). Reports carry running totals, so a lost,
late or repeated one changes nothing but the age of what syncd knows. A link's rate is its bytes
over the last `RATE_WINDOW_S` seconds (from the start of the transfer while it is younger); its
ETA is what is left at that rate. The refit's ETA is its slowest link's, or the whole refit's at
the sum of the rates if that is later, plus what verify and commit took on average; before any
link moved it comes from the `TransferModel` fitted on past refits (`EtaSource` says which).

Lifecycle: made when TRANSFERRING starts (`start`), fed by reports until the refit ends
(`conclude`), then kept as it ended; `snapshot` is safe from any thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from syncd.commands import ProgressReport
from syncd.plan import Plan
from syncd.states import RefitState

RATE_WINDOW_S = 10.0

LinkKey = tuple[int, str, str]  # (stage, src, dst)


class EtaSource(StrEnum):
    LIVE = "live"  # the links' rates
    MODEL = "model"  # past refits (`syncd.daemon.transfer_model`), before any link moved
    NONE = "none"  # no estimate yet (no refit observed, nothing moved), or the refit ended


@dataclass(frozen=True)
class Share:
    """Bytes done of a total (a link, a stage, a member's incoming links), and its rate now."""

    done: int
    total: int
    rate: float  # bytes per second

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0


@dataclass(frozen=True)
class LinkShare:
    stage: int
    src: str
    dst: str
    relay: bool  # src is a replica forwarding what it received (fan-out)
    share: Share
    eta_s: float | None  # None: nothing moved on it yet


@dataclass(frozen=True)
class RefitProgress:
    """A refit's progress as syncd knows it now. `eta_s`: seconds until the refit ends (verify and
    commit included); `slowest`: the link that ends last at its rate (its dst names the member,
    its src the relay or trainer rank), None when nothing moves; `since_progress_s`: seconds since
    bytes last arrived (or since the transfer started)."""

    refit_id: str
    state: RefitState
    total: Share
    eta_s: float | None
    eta_source: EtaSource
    elapsed_s: float  # since TRANSFERRING started
    since_progress_s: float
    stages: dict[int, Share]
    members: dict[str, Share]  # receiving member -> its incoming links
    links: tuple[LinkShare, ...]
    slowest: LinkShare | None
    updated_at: float  # wall clock


class TransferProgress:
    def __init__(
        self,
        refit_id: str,
        plan: Plan,
        estimate_s: float | None,
        after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`estimate_s`: the model's seconds for the whole refit from now (None: no model yet);
        `after_s`: what verify and commit add to a live transfer ETA."""
        self.refit_id = refit_id
        self._clock = clock
        self._start = clock()
        self._estimate_s, self._after_s = estimate_s, after_s
        self._lock = threading.Lock()
        links = plan.links()
        self._total: dict[LinkKey, int] = {(k.stage, k.src, k.dst): k.bytes for k in links}
        self._relay = {(k.stage, k.src, k.dst) for k in links if k.relay}
        self._done = dict.fromkeys(self._total, 0)
        self._samples: dict[LinkKey, deque[tuple[float, int]]] = {
            k: deque([(self._start, 0)]) for k in self._total
        }
        self._last_progress = self._start
        self._ended_at: float | None = None
        self._state = RefitState.TRANSFERRING

    @property
    def state(self) -> RefitState:
        """TRANSFERRING until `conclude` says how it ended."""
        return self._state

    @property
    def busiest_link_bytes(self) -> int:
        return max(self._total.values(), default=0)

    def add(self, report: ProgressReport) -> None:
        with self._lock:
            if self._ended_at is not None:
                return
            for (stage, src), n in report.links.items():
                self._advance((stage, src, report.member_id), n)

    def member_done(self, member_id: str) -> None:
        """The member reported TRANSFERRED: every link into it is complete."""
        with self._lock:
            for key, total in self._total.items():
                if key[2] == member_id:
                    self._advance(key, total)

    def conclude(self, state: RefitState) -> None:
        """The refit ended in `state`; a committed one moved every byte."""
        with self._lock:
            if state == RefitState.COMMITTED:
                for key, total in self._total.items():
                    self._advance(key, total)
            self._state, self._ended_at = state, self._clock()

    def _advance(self, key: LinkKey, n: int) -> None:
        total = self._total.get(key)
        if total is None:  # not a link of the plan
            return
        n = min(n, total)
        if n <= self._done[key]:
            return
        now = self._clock()
        self._done[key], self._last_progress = n, now
        samples = self._samples[key]
        samples.append((now, n))
        while len(samples) > 2 and samples[1][0] < now - RATE_WINDOW_S:
            samples.popleft()

    def snapshot(self, state: RefitState) -> RefitProgress:
        """As it stands now, in the refit's `state` (the caller's, from the refit's record)."""
        with self._lock:
            now = self._clock() if self._ended_at is None else self._ended_at
            links = tuple(self._link(key, now) for key in sorted(self._total))
            since = now - self._last_progress
        total = _sum(s.share for s in links)
        running = self._ended_at is None and state == RefitState.TRANSFERRING
        moving = [s for s in links if s.eta_s is not None and s.share.done < s.share.total]
        slowest = max(moving, key=lambda s: s.eta_s or 0.0, default=None) if running else None
        eta, source = self._eta(total, slowest, now, running)
        return RefitProgress(
            refit_id=self.refit_id,
            state=state,
            total=total,
            eta_s=eta,
            eta_source=source,
            elapsed_s=now - self._start,
            since_progress_s=since,
            stages={stage: _sum(s.share for s in links if s.stage == stage) for stage in _stages(links)},
            members={m: _sum(s.share for s in links if s.dst == m) for m in sorted({s.dst for s in links})},
            links=links,
            slowest=slowest,
            updated_at=time.time(),
        )

    def _link(self, key: LinkKey, now: float) -> LinkShare:
        done, total = self._done[key], self._total[key]
        t0, n0 = self._samples[key][0]
        rate = (done - n0) / (now - t0) if done > n0 and now > t0 else 0.0
        if done >= total:
            eta: float | None = 0.0
        else:
            eta = (total - done) / rate if rate > 0 else None
        return LinkShare(key[0], key[1], key[2], key in self._relay, Share(done, total, rate), eta)

    def _eta(
        self, total: Share, slowest: LinkShare | None, now: float, running: bool
    ) -> tuple[float | None, EtaSource]:
        if not running:
            return None, EtaSource.NONE
        left = total.total - total.done
        if total.rate > 0:
            slowest_s = slowest.eta_s if slowest is not None and slowest.eta_s is not None else 0.0
            transfer = max(left / total.rate, slowest_s)
            return transfer + self._after_s, EtaSource.LIVE
        if self._estimate_s is not None:
            return max(self._estimate_s - (now - self._start), 0.0), EtaSource.MODEL
        return None, EtaSource.NONE


def _sum(shares) -> Share:
    done = total = 0
    rate = 0.0
    for s in shares:
        done, total, rate = done + s.done, total + s.total, rate + s.rate
    return Share(done, total, rate)


def _stages(links: tuple[LinkShare, ...]) -> list[int]:
    return sorted({s.stage for s in links})
