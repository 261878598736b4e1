"""Refit records as syncd knows them: in memory at once, in the store as soon as it accepts them.

A refit's outcome must never wait for the database (a backup or an operator's `sqlite3` shell may
hold its lock for minutes) and must never be lost because a write failed. `record` keeps the
newest record of each refit in memory and a writer thread persists them in order, retrying until
the store accepts them; reads see the unpersisted records over the stored ones.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from syncd.daemon.store import RefitRecord, Store, StoreUnavailable

log = logging.getLogger(__name__)

_RETRY_S = 1.0


class Journal:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._cond = threading.Condition()
        self._pending: OrderedDict[str, RefitRecord] = OrderedDict()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="journal", daemon=True)
        self._writer.start()

    def record(self, r: RefitRecord) -> None:
        """Queue `r` (replacing an unwritten older record of the same refit); never blocks on I/O."""
        with self._cond:
            self._pending[r.id] = r
            self._pending.move_to_end(r.id)
            self._cond.notify()

    def get(self, refit_id: str) -> RefitRecord | None:
        with self._cond:
            pending = self._pending.get(refit_id)
        return pending if pending is not None else self.store.get(refit_id)

    def history(self, limit: int) -> list[RefitRecord]:
        """Newest first (refit ids count up, so pending records sort in by their number)."""
        with self._cond:
            pending = dict(self._pending)
        stored = [r for r in self.store.history(limit) if r.id not in pending]
        merged = sorted([*stored, *pending.values()], key=lambda r: _number(r.id), reverse=True)
        return merged[:limit]

    def unwritten(self) -> int:
        with self._cond:
            return len(self._pending)

    def flush(self, timeout: float) -> bool:
        """Wait until every record is written; False if some are still pending after `timeout`."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float = 5.0) -> None:
        if not self.flush(timeout):
            log.error("%d refit records could not be written to %s", self.unwritten(), self.store.path)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._writer.join(timeout)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    return
                refit_id, r = next(iter(self._pending.items()))
            try:
                self.store.update(r)
            except StoreUnavailable as e:
                log.warning("refit %s: %s; retrying in %gs", refit_id, e, _RETRY_S)
                with self._cond:
                    self._cond.wait(_RETRY_S)
                continue
            with self._cond:
                if self._pending.get(refit_id) is r:  # not replaced meanwhile
                    del self._pending[refit_id]
                self._cond.notify_all()


def _number(refit_id: str) -> int:
    return int(refit_id.rsplit("-", 1)[1])
