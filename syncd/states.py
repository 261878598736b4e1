"""The states of a refit, as syncd records them (SQLite), reports them (HTTP, `syncctl`) and
labels its metrics with them (lower case). A StrEnum: each state is also its plain string, which
is what travels in JSON and sits in the database. A client waits for a final one with
`syncd.refit_wait.wait_final`."""

from __future__ import annotations

from enum import StrEnum


class RefitState(StrEnum):
    PREPARING = "PREPARING"  # membership, plan and groups agreed
    TRANSFERRING = "TRANSFERRING"
    VERIFYING = "VERIFYING"  # checksums compared
    COMMITTING = "COMMITTING"
    COMMITTED = "COMMITTED"  # final: the version is live (unconfirmed members listed)
    ABORTED = "ABORTED"  # final: the previous version stays live


TERMINAL = frozenset({RefitState.COMMITTED, RefitState.ABORTED})
