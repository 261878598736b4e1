"""What a trainer learns of the refits of the versions it announced: one meaning of "refitted".

A version is refitted when every generator serves it: syncd's refit of it (or of a newer version
of the same run) COMMITTED and every member confirmed its Commit, which a generator does only once
its install finished. A trainer rank hears its own Commit as soon as syncd decides, before any
generator installed, so it asks syncd instead (`MemberClient.version_status`, the VersionStatus
RPC: `syncd.daemon.version_status`), until that refit ended or the wait's time is up.

`wait_served` returns the refit's `RefitOutcome` or raises `RefitFailed` naming what syncd
recorded: the refit's id and state, the member that failed and why (an aborted refit; a commit
that a generator did not confirm, say a failed install), or, when no refit of the version started
in time, why none did (syncd runs without `--auto-refit`, a generator is missing, an older refit
still runs). `syncd.member.attach` (`wait_s`, `wait_refit`, `last_refit`) and trainer_svc's
`--sync-refit` wait through it. A trainer that goes on without waiting reads the newest outcome
with `newest_outcome`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Protocol

import grpc

from syncd.states import RefitState
from syncd.weight_version import Version, WeightVersion

POLL_S = 0.2  # how often a waiting rank asks syncd
_NAMED_MEMBER = re.compile(r"\bmember (\S+?)[:,]? ")  # syncd's causes: "member X failed ...", "... lost"


class VersionStatusSource(Protocol):
    """What the wait needs of a member's client (`MemberClient`)."""

    def version_status(self, version: WeightVersion): ...


@dataclass(frozen=True)
class RefitOutcome:
    """One refit as syncd recorded it: `reason` is its recorded error ("" for a clean commit),
    `seconds` from its start to its end (or so far), `bytes` received by the generators,
    `unconfirmed` the members that did not confirm its Commit; `ended` once it can change no more."""

    id: str
    version: Version
    state: RefitState
    reason: str
    seconds: float
    bytes: int
    unconfirmed: tuple[str, ...] = ()
    ended: bool = True

    @property
    def served(self) -> bool:
        """Every generator serves its version."""
        return self.ended and self.state == RefitState.COMMITTED and not self.unconfirmed

    def __str__(self) -> str:
        said = f"{self.id} of version {self.version}: {self.state} after {self.seconds:.2f} s"
        said += f", {self.bytes} bytes"
        return f"{said}: {self.reason}" if self.reason else said


class RefitFailed(Exception):
    """A version the trainer waited for is not served by every generator: `refit_id` and `state`
    of syncd's refit of it ("" and None when none started), `member` the member(s) syncd's record
    names ("" when it names none), `reason` what syncd recorded or why no refit started."""

    def __init__(
        self, version: Version, outcome: RefitOutcome | None, member: str, reason: str, message: str
    ) -> None:
        super().__init__(message)
        self.version, self.outcome, self.member, self.reason = version, outcome, member, reason
        self.refit_id = outcome.id if outcome is not None else ""
        self.state = outcome.state if outcome is not None else None


def outcome_of(response) -> RefitOutcome | None:
    """The refit a VersionStatus answer names, None when it names none."""
    if not response.refit_id:
        return None
    return RefitOutcome(
        id=response.refit_id,
        version=Version.of_step(response.weight_version),
        state=RefitState(response.state),
        reason=response.error,
        seconds=response.seconds,
        bytes=response.bytes,
        unconfirmed=tuple(response.unconfirmed),
        ended=response.ended,
    )


def newest_outcome(client: VersionStatusSource) -> RefitOutcome | None:
    """The newest refit of the client's run, ended or not; None before any. Raises grpc.RpcError
    or RuntimeError when syncd cannot answer now."""
    return outcome_of(client.version_status(WeightVersion(0)))


def failure(version: Version, outcome: RefitOutcome) -> RefitFailed:
    """The RefitFailed of an ended refit that left `version` unserved."""
    if outcome.state == RefitState.COMMITTED:
        member = ", ".join(outcome.unconfirmed)
        message = (
            f"version {version} is not served by every generator: {outcome.id} COMMITTED, but "
            f"{member} did not confirm it: {outcome.reason}"
        )
    else:
        named = _NAMED_MEMBER.search(outcome.reason)
        member = named.group(1) if named else ""
        message = f"version {version} was not refitted: {outcome.id} {outcome.state}: {outcome.reason}"
    return RefitFailed(version, outcome, member, outcome.reason, message)


def wait_served(client: VersionStatusSource, version: WeightVersion, timeout_s: float) -> RefitOutcome:
    """Block until every generator serves `version` (or a newer version of the run) and return
    the refit that did it; raise RefitFailed when that refit ended otherwise, or when `timeout_s`
    passed first (naming the refit still running, or why none started). Syncd out of reach
    (restarting, this member re-registering) is waited through."""
    wanted = Version.of_step(version)
    deadline = time.monotonic() + timeout_s
    outcome, waiting_for, unreachable = None, "", ""
    while True:
        try:
            response = client.version_status(version)
        except (grpc.RpcError, RuntimeError) as e:
            unreachable = f"syncd did not answer: {e.details() if isinstance(e, grpc.RpcError) else e}"
        else:
            outcome, waiting_for, unreachable = outcome_of(response), response.waiting_for, ""
            if outcome is not None and outcome.ended:
                if outcome.served:
                    return outcome
                raise failure(wanted, outcome)
        if time.monotonic() >= deadline:
            raise _late(wanted, outcome, unreachable or waiting_for, timeout_s)
        time.sleep(POLL_S)


def _late(version: Version, outcome: RefitOutcome | None, why: str, timeout_s: float) -> RefitFailed:
    if outcome is not None:
        reason = f"{outcome.id} is still {outcome.state} after {timeout_s:g} s"
        return RefitFailed(version, outcome, "", reason, f"version {version} is not served yet: {reason}")
    reason = why or "syncd gave no reason"
    message = f"no refit of version {version} started within {timeout_s:g} s: {reason}"
    return RefitFailed(version, None, "", reason, message)
