"""Durable state in SQLite (stdlib sqlite3): refit history, the commit decisions and the committed
weight version.

Members are not stored: after a restart they re-register (their clients do it automatically).
When the store reopens, a refit that was running is recorded as ABORTED (its groups and staged
weights did not survive), except one whose commit decision had been written: that one stays
COMMITTED, since members may already run its version, with the members that had not confirmed
it listed as unconfirmed.

Every thread gets its own connection, so reads never queue behind a write that waits for
SQLite's lock (WAL readers do not block on writers). Writes wait up to `busy_timeout` seconds for
the lock and are retried `attempts` times; then they raise `StoreUnavailable`, which callers
treat as an outcome, never as a crash.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from syncd.states import TERMINAL, RefitState
from syncd.weight_version import WeightVersion

_STOPPED_NOTE = "syncd stopped while Commit was in flight; members report their version on registration"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS refits (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    state TEXT NOT NULL,
    weight_version INTEGER NOT NULL,
    created_at REAL NOT NULL,
    finished_at REAL,
    error TEXT NOT NULL DEFAULT '',
    phases TEXT NOT NULL DEFAULT '{}',
    bytes INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_COLUMNS = (
    "id, state, weight_version, created_at, finished_at, error, phases, bytes, unconfirmed, run_id, "
    "planned_bytes, delta_generators, delta_elements, changed_elements, left_out, adapter"
)
# Columns added after the first release, with their definitions (added when a store opens).
_ADDED_COLUMNS = {
    "unconfirmed": "TEXT NOT NULL DEFAULT '[]'",
    "run_id": "TEXT NOT NULL DEFAULT ''",
    "planned_bytes": "INTEGER NOT NULL DEFAULT 0",
    "delta_generators": "TEXT NOT NULL DEFAULT '[]'",
    "delta_elements": "INTEGER NOT NULL DEFAULT 0",
    "changed_elements": "INTEGER NOT NULL DEFAULT 0",
    "left_out": "TEXT NOT NULL DEFAULT '[]'",
    "adapter": "TEXT NOT NULL DEFAULT ''",
}

T = TypeVar("T")


class StoreUnavailable(Exception):
    """A write did not reach the database (locked for too long, disk full, I/O error)."""


@dataclass(frozen=True, kw_only=True)
class RefitRecord:
    """One refit as syncd records and reports it; built by name (`Run.snapshot`, the store's rows)."""

    id: str
    state: RefitState
    weight_version: WeightVersion
    created_at: float
    finished_at: float | None = None
    error: str = ""
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds spent in it
    bytes: int = 0
    unconfirmed: tuple[str, ...] = ()  # COMMITTED: members that did not confirm Commit
    run_id: str = ""  # the training run of weight_version: (run_id, weight_version) names the weights
    planned_bytes: int = 0  # bytes the plan moves to generators, set when TRANSFERRING starts
    delta_generators: tuple[str, ...] = ()  # generators that received only what changed
    delta_elements: int = 0  # elements of their units,
    changed_elements: int = 0  # and how many of them changed
    left_out: tuple[str, ...] = ()  # generators it went without: missing, or lost and retried without
    adapter: str = ""  # a refit of this named LoRA adapter into the generators' slots; "": the base

    @property
    def mode(self) -> str:
        """ "delta" when some generator received only what changed (`delta_generators`), else "full"."""
        return "delta" if self.delta_generators else "full"

    @property
    def changed_fraction(self) -> float | None:
        return self.changed_elements / self.delta_elements if self.delta_elements else None

    @property
    def saved_bytes(self) -> int:
        """What the delta links did not move, of the plan's full bytes."""
        return max(self.planned_bytes - self.bytes, 0) if self.delta_generators else 0


class Store:
    def __init__(self, path: str, busy_timeout: float = 5.0, attempts: int = 3) -> None:
        self.path = path
        self.busy_timeout = busy_timeout
        self.attempts = attempts
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        db = self._db()
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(_SCHEMA)
        present = {row[1] for row in db.execute("PRAGMA table_info(refits)")}
        for column, definition in _ADDED_COLUMNS.items():
            if column not in present:
                db.execute(f"ALTER TABLE refits ADD COLUMN {column} {definition}")
        self._recover()

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(
                self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False
            )
            self._local.db = db
            with self._connections_lock:
                self._connections.append(db)
        return db

    def _recover(self) -> None:
        now = time.time()
        with self._transaction() as db:
            db.execute(
                f"UPDATE refits SET state=?, error='syncd stopped during the refit', finished_at=? "
                f"WHERE state NOT IN ({', '.join('?' * len(TERMINAL))})",
                (RefitState.ABORTED, now, *sorted(TERMINAL)),
            )
            db.execute(
                "UPDATE refits SET finished_at=?, error=? WHERE state=? AND finished_at IS NULL",
                (now, _STOPPED_NOTE, RefitState.COMMITTED),
            )

    def close(self) -> None:
        with self._connections_lock:
            for db in self._connections:
                db.close()
            self._connections.clear()

    # ---- writes ----

    def create(
        self,
        state: RefitState,
        weight_version: WeightVersion,
        run_id: str,
        created_at: float,
        adapter: str = "",
    ) -> RefitRecord:
        """Insert a new refit; its id is `refit-<n>`, n counting refits without gaps. `adapter`:
        a refit of that named adapter (its versions are the adapter's)."""

        def insert() -> str:
            with self._transaction() as db:
                (n,) = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM refits").fetchone()
                db.execute(
                    "INSERT INTO refits (seq, id, state, weight_version, created_at, run_id, adapter) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (n, f"refit-{n}", state, weight_version, created_at, run_id, adapter),
                )
            return f"refit-{n}"

        return RefitRecord(
            id=self._retry(insert),
            state=state,
            weight_version=weight_version,
            created_at=created_at,
            run_id=run_id,
            adapter=adapter,
        )

    def update(self, r: RefitRecord) -> None:
        self._retry(lambda: self._update(self._db(), r))

    def decide_commit(self, r: RefitRecord, meta: dict[str, str] | None = None) -> None:
        """The commit decision: the refit COMMITTED (members still unconfirmed) and the committed
        version, in one transaction, before any member is told to commit. `meta`: the keys that
        record the committed version when they are not the base weights' (an adapter's)."""
        if meta is None:
            meta = {"committed_version": str(r.weight_version), "committed_run": r.run_id}

        def write() -> None:
            with self._transaction() as db:
                self._update(db, r)
                for key, value in meta.items():
                    self._set(db, key, value)

        self._retry(write)

    def set_meta(self, values: dict[str, str | None]) -> None:
        """Set (None: delete) several meta keys in one transaction."""

        def write() -> None:
            with self._transaction() as db:
                for key, value in values.items():
                    if value is None:
                        db.execute("DELETE FROM meta WHERE key = ?", (key,))
                    else:
                        self._set(db, key, value)

        self._retry(write)

    @staticmethod
    def _update(db: sqlite3.Connection, r: RefitRecord) -> None:
        db.execute(
            "UPDATE refits SET state=?, finished_at=?, error=?, phases=?, bytes=?, unconfirmed=?, "
            "planned_bytes=?, delta_generators=?, delta_elements=?, changed_elements=?, left_out=? "
            "WHERE id=?",
            (
                r.state,
                r.finished_at,
                r.error,
                json.dumps(r.phases),
                r.bytes,
                json.dumps(list(r.unconfirmed)),
                r.planned_bytes,
                json.dumps(list(r.delta_generators)),
                r.delta_elements,
                r.changed_elements,
                json.dumps(list(r.left_out)),
                r.id,
            ),
        )

    @staticmethod
    def _set(db: sqlite3.Connection, key: str, value: str) -> None:
        db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, value),
        )

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db())

    def _retry(self, write: Callable[[], T]) -> T:
        for attempt in range(1, self.attempts + 1):
            try:
                return write()
            except sqlite3.OperationalError as e:
                if attempt == self.attempts:
                    raise StoreUnavailable(
                        f"store {self.path}: {e} ({self.attempts} attempts, {self.busy_timeout:g}s busy "
                        f"timeout each)"
                    ) from None
            except (sqlite3.DatabaseError, OverflowError) as e:
                raise StoreUnavailable(f"store {self.path}: {type(e).__name__}: {e}") from None
        raise AssertionError("unreachable")

    # ---- reads ----

    def get(self, refit_id: str) -> RefitRecord | None:
        rows = self._select("WHERE id = ?", (refit_id,))
        return rows[0] if rows else None

    def history(self, limit: int = 100) -> list[RefitRecord]:
        """Newest first."""
        return self._select("ORDER BY seq DESC LIMIT ?", (limit,))

    def _select(self, where: str, args: tuple) -> list[RefitRecord]:
        rows = self._db().execute(f"SELECT {_COLUMNS} FROM refits {where}", args).fetchall()
        return [
            RefitRecord(
                id=r[0],
                state=RefitState(r[1]),
                weight_version=r[2],
                created_at=r[3],
                finished_at=r[4],
                error=r[5],
                phases=json.loads(r[6]),
                bytes=r[7],
                unconfirmed=tuple(json.loads(r[8])),
                run_id=r[9],
                planned_bytes=r[10],
                delta_generators=tuple(json.loads(r[11])),
                delta_elements=r[12],
                changed_elements=r[13],
                left_out=tuple(json.loads(r[14])),
                adapter=r[15],
            )
            for r in rows
        ]

    def get_text(self, key: str) -> str | None:
        row = self._db().execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def get_int(self, key: str) -> int | None:
        row = self._db().execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        try:
            return int(row[0])
        except ValueError:
            raise ValueError(
                f"store {self.path}: meta.{key} is {row[0]!r}, not an integer; fix or delete that row"
            ) from None


class _Transaction:
    """`with _Transaction(db) as db:` BEGIN IMMEDIATE ... COMMIT, ROLLBACK on error."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind: object, *_: object) -> None:
        if kind is None:
            try:
                self.db.execute("COMMIT")
                return
            except sqlite3.Error:
                self.db.execute("ROLLBACK")
                raise
        self.db.execute("ROLLBACK")
