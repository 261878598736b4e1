"""Durable state in SQLite (stdlib sqlite3): refit history and the committed weight version.

Members are not stored: after a restart they re-register (their clients do it automatically).
A refit that was running when syncd stopped is recorded as ABORTED when the store reopens, since
its groups and staged weights did not survive.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field

TERMINAL = ("COMMITTED", "ABORTED")

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


@dataclass(frozen=True)
class RefitRecord:
    id: str
    state: str
    weight_version: int
    created_at: float
    finished_at: float | None = None
    error: str = ""
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds spent in it
    bytes: int = 0


class Store:
    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        with self._lock:
            self._db.execute(
                "UPDATE refits SET state='ABORTED', error='syncd stopped during the refit', finished_at=? "
                "WHERE state NOT IN ('COMMITTED', 'ABORTED')",
                (time.time(),),
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def new_refit_id(self) -> str:
        with self._lock:
            (seq,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM refits").fetchone()
        return f"refit-{seq}"

    def save(self, r: RefitRecord) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO refits "
                "(id, state, weight_version, created_at, finished_at, error, phases, bytes) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET state=excluded.state, "
                "finished_at=excluded.finished_at, error=excluded.error, phases=excluded.phases, "
                "bytes=excluded.bytes",
                (r.id, r.state, r.weight_version, r.created_at, r.finished_at, r.error,
                 json.dumps(r.phases), r.bytes),
            )

    def get(self, refit_id: str) -> RefitRecord | None:
        rows = self._select("WHERE id = ?", (refit_id,))
        return rows[0] if rows else None

    def history(self, limit: int = 100) -> list[RefitRecord]:
        """Newest first."""
        return self._select("ORDER BY seq DESC LIMIT ?", (limit,))

    def _select(self, where: str, args: tuple) -> list[RefitRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, state, weight_version, created_at, finished_at, error, phases, bytes "
                f"FROM refits {where}", args,
            ).fetchall()
        return [RefitRecord(r[0], r[1], r[2], r[3], r[4], r[5], json.loads(r[6]), r[7]) for r in rows]

    def get_int(self, key: str) -> int | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else int(row[0])

    def set_int(self, key: str, value: int) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (key, str(value)),
            )
