"""What a refit's transfer takes, fitted on past refits (`TransferModel`): the ETA of a refit
before its members reported any bytes (`syncd.daemon.progress`).

The model: transfer seconds = a fixed overhead + the busiest link's bytes / the bandwidth of one
link (links run in parallel; a chain of relays forwards while it receives), plus the seconds
VERIFYING and committing took on average. It is fitted by least squares on the last
`MAX_OBSERVATIONS` full refits that committed (delta refits move what changed, not what the plan
says) and kept in the store's meta table, so a restarted syncd still has it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

from syncd.daemon.store import Store, StoreUnavailable

log = logging.getLogger(__name__)

MAX_OBSERVATIONS = 32
_META_KEY = "transfer_model"


@dataclass(frozen=True)
class Observation:
    """One committed full refit: its busiest link's bytes, its TRANSFERRING seconds, and the
    seconds from then to its end (VERIFYING and committing)."""

    link_bytes: int
    transfer_s: float
    after_s: float


@dataclass(frozen=True)
class Fit:
    overhead_s: float
    bandwidth: float  # bytes per second of one link
    after_s: float

    def seconds(self, link_bytes: int) -> float:
        """The whole refit from the start of its transfer: transfer, verify and commit."""
        return self.overhead_s + link_bytes / self.bandwidth + self.after_s


def fit(observations: list[Observation]) -> Fit | None:
    """Least squares of transfer_s on link_bytes; a slope or overhead the data cannot support
    (one refit, or all of one size, or a negative overhead) falls back to no overhead and the mean
    bandwidth. None without observations."""
    usable = [o for o in observations if o.link_bytes > 0 and o.transfer_s > 0]
    if not usable:
        return None
    after_s = sum(o.after_s for o in usable) / len(usable)
    n = len(usable)
    mean_x = sum(o.link_bytes for o in usable) / n
    mean_y = sum(o.transfer_s for o in usable) / n
    sxx = sum((o.link_bytes - mean_x) ** 2 for o in usable)
    if sxx > 0:
        slope = sum((o.link_bytes - mean_x) * (o.transfer_s - mean_y) for o in usable) / sxx
        overhead = mean_y - slope * mean_x
        if slope > 0 and overhead >= 0:
            return Fit(overhead, 1 / slope, after_s)
    return Fit(0.0, sum(o.link_bytes for o in usable) / sum(o.transfer_s for o in usable), after_s)


class TransferModel:
    """The observations and their fit; loaded from the store when syncd starts."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._observations = _load(store)
        self._fit = fit(self._observations)

    @property
    def observations(self) -> int:
        return len(self._observations)

    def estimate_s(self, link_bytes: int) -> float | None:
        """Seconds a refit whose busiest link moves `link_bytes` takes from the start of its
        transfer to its end; None until a refit was observed."""
        return None if self._fit is None else self._fit.seconds(link_bytes)

    def after_transfer_s(self) -> float:
        """Seconds VERIFYING and committing take on average (0 until a refit was observed)."""
        return 0.0 if self._fit is None else self._fit.after_s

    def observe(self, observation: Observation) -> None:
        self._observations = [*self._observations, observation][-MAX_OBSERVATIONS:]
        self._fit = fit(self._observations)
        try:
            self._store.set_meta({_META_KEY: json.dumps([asdict(o) for o in self._observations])})
        except StoreUnavailable as e:  # the model is a convenience: the refit's outcome is recorded
            log.warning("transfer model not saved: %s", e)


def _load(store: Store) -> list[Observation]:
    text = store.get_text(_META_KEY)
    if text is None:
        return []
    try:
        return [Observation(**o) for o in json.loads(text)][-MAX_OBSERVATIONS:]
    except (ValueError, TypeError) as e:
        log.warning("store %s: meta.%s is no list of observations (%s): ignored", store.path, _META_KEY, e)
        return []
