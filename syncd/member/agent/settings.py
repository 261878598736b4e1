"""How one member's agent runs its transfers (`AgentSettings`), fixed for its lifetime."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from syncd.member.agent.progress import interval_from_env
from syncd.member.dataplane.landing_fault import fault_file_from_env


@dataclass(frozen=True)
class AgentSettings:
    # The address this member reported: a gloo store it hosts and its gloo sockets listen there.
    host: str = "127.0.0.1"
    device: str = "cpu"
    in_flight: int = 2  # staging buffers per stage and direction
    # Keep Python's collector off while this member's transfers run: a full collection stalls
    # the host for tens of ms mid-transfer (`syncd.member.dataplane.gc_pause`). A member process
    # has one agent, so its pause covers all of the process's transfers.
    pause_gc: bool = True
    # Tests only: the file that arms a fault in this member's receives, from
    # WEIGHTSYNC_TEST_LANDING_FAULT_FILE (`syncd.member.dataplane.landing_fault`); unset: none.
    landing_fault_file: Path | None = field(default_factory=fault_file_from_env)
    # Seconds between progress reports while it transfers (`syncd.member.agent.progress`), from
    # WEIGHTSYNC_PROGRESS_INTERVAL_S; 0: none.
    progress_interval_s: float = field(default_factory=interval_from_env)
