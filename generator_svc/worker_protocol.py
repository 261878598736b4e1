"""What crosses the boundary between the API-server process and vLLM's worker processes.

The API server (`generator_svc.server`, or `generator_svc.attach` for an engine a user built) and the
workers (`generator_svc.worker`) never import each other; they share these types instead.

Calls: the API server calls the worker extension's `ws_*` methods on every worker with vLLM's
`collective_rpc`, which returns one reply per worker (tensor-parallel rank order). vLLM carries the
arguments and replies with msgpack between the API server and its engine core process (a dataclass
arrives there as a mapping unless `VLLM_ALLOW_INSECURE_SERIALIZATION` is set, which we do not ask
for) and with pickle between the engine core and the workers. So every message here crosses as
`to_wire()`, a dict of plain values, and is read back with `Type.from_wire(raw)`, which also takes
the message itself (an engine whose core runs in the caller's process passes objects through):

    API server                                   worker (`WeightSyncExtension`)
    ws_setup(WorkerSetup)                    ->  WorkerInfo            catalog built, syncd joined
    ws_stage_file(path, refit_id)            ->  StagedFile            a checkpoint file staged
    ws_status()                              ->  CommitReadiness       what is ready to commit
    ws_committed(CommitOutcome)              ->  None                  the outcome of a Commit
    ws_digest()                              ->  WorkerDigest          checksums of the served version
    ws_last_install()                        ->  WorkerInstall | None  what the last install did
    (ws_catalog: the catalog's JSON; ws_hold, ws_abort: a refit id; ws_release: layers installed)

Files: `WorkerStatus`, what each worker publishes about itself into a status file (JSON,
`status_path`), which the API server's probes read without calling into the worker.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Self

from generator_svc.settings import RefitMode
from syncd.weight_version import WeightVersion

# How often each worker rewrites its status file; the API server's probes count missed writes.
PUBLISH_INTERVAL_S = 0.5


class WireMessage:
    """A dataclass (frozen, but for `WorkerInstall`) that crosses `collective_rpc` as a dict of
    plain values."""

    def to_wire(self) -> dict[str, Any]:
        declared = fields(self)  # type: ignore[arg-type]  # every subclass is a dataclass
        return {f.name: _plain(getattr(self, f.name)) for f in declared}

    @classmethod
    def from_wire(cls, raw: Self | Mapping[str, Any]) -> Self:
        """The message `raw` carries; TypeError naming the message and its fields when `raw` is
        no such message (a reply of another method, or of another version of this code)."""
        if isinstance(raw, cls):
            return raw
        declared = fields(cls)  # type: ignore[arg-type]  # every subclass is a dataclass
        names = {f.name for f in declared}
        required = {f.name for f in declared if f.default is MISSING and f.default_factory is MISSING}
        if not isinstance(raw, Mapping) or not required <= set(raw) <= names:
            raise TypeError(f"expected a {cls.__name__} ({', '.join(sorted(names))}), got {raw!r}")
        return cls(**raw)

    @classmethod
    def replies(cls, raw: Iterable[Self | Mapping[str, Any]]) -> list[Self]:
        """Every worker's reply of a `collective_rpc` call, as messages."""
        return [cls.from_wire(r) for r in raw]


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value


@dataclass(frozen=True)
class WorkerSetup(WireMessage):
    """`ws_setup`: how a worker takes part in weight sync (the generator's settings it needs).
    `syncd` empty: no syncd (refits from files only); `internal_url`: where tp rank 0 relays
    syncd's commands (`/commit`, `/hold`, `/release`), with `commit_token`; `status_dir`: where the
    worker publishes its `WorkerStatus` (empty: it does not)."""

    replica: int
    syncd: str = ""
    auth_token: str = ""
    internal_url: str = ""
    commit_token: str = ""
    data_host: str = "127.0.0.1"
    in_flight: int = 2
    status_dir: str = ""
    refit_mode: RefitMode = RefitMode.STAGED
    hold_limit_s: float = 300.0
    keep_delta_base: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "refit_mode", RefitMode(self.refit_mode))


@dataclass(frozen=True)
class WorkerInfo(WireMessage):
    """`ws_setup`'s reply: the worker as syncd knows it, and its catalog (`shapes_checked`: tensors
    whose shape was checked against what vLLM allocated)."""

    member_id: str
    pid: int
    tp_rank: int
    tp_size: int
    catalog_hash: str
    nbytes: int
    shapes_checked: int


@dataclass(frozen=True)
class StagedFile(WireMessage):
    """`ws_stage_file`'s reply: canonical tensors staged and unknown ones skipped, or, when the
    input is no checkpoint of this catalog, why (`rejected`; exceptions cross `collective_rpc` as
    text, so the API server could not tell bad input from a bug)."""

    member_id: str
    tensors: int = 0
    skipped: int = 0
    rejected: str = ""


@dataclass(frozen=True)
class CommitReadiness(WireMessage):
    """`ws_status`'s reply: the refit whose bytes this worker holds (staging, or the open in-place
    install; None: none) and the first of what is still missing of it."""

    member_id: str
    refit_id: str | None
    missing: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "missing", tuple(self.missing))

    def problem(self) -> str:
        """Why this worker cannot commit ('' when it can)."""
        if not self.refit_id:
            return f"{self.member_id}: nothing staged"
        return f"{self.member_id}: {', '.join(self.missing)}" if self.missing else ""


@dataclass(frozen=True)
class CommitOutcome(WireMessage):
    """`ws_committed`: how the API server's apply of `version` for refit `refit_id` ended; each
    worker reports it to syncd (`error` names the failure)."""

    refit_id: str
    version: str
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class WorkerDigest(WireMessage):
    """`ws_digest`'s reply: checksums, by canonical region, of what this worker holds of the
    version it serves (`generator_svc.worker.digest`); unavailable, with the reason, when it holds
    no copy of it in checkpoint format."""

    member_id: str
    version: str
    available: bool
    reason: str
    checksums: dict[str, str] = field(default_factory=dict)


@dataclass
class WorkerInstall(WireMessage):
    """What one install did on a worker and how long each part took (seconds, summed over layers):
    filled in by the install as it runs (`generator_svc.worker.install`, `.inplace`), kept as the
    worker's last, and `ws_last_install`'s reply. Not frozen, as the only message that is built up
    field by field. The memory fields are the in-place install's: its receive buffers, the largest
    bucket, and the peak of the checkpoint tensors of layers being received."""

    params_copied: int = 0
    bytes_copied: int = 0
    layers_processed: int = 0
    layers_kept: int = 0  # a delta refit changed nothing in them: their kernel tensors stay
    fallback_params: list[str] = field(default_factory=list)  # installed through vLLM's loaders
    copy_s: float = 0.0
    process_s: float = 0.0
    total_s: float = 0.0
    receive_buffer_bytes: int = 0
    bucket_bytes: int = 0
    peak_open_bytes: int = 0


@dataclass(frozen=True)
class WorkerStatus:
    member_id: str
    pid: int
    unregistered: bool  # syncd is configured but this worker has no session with it (yet)
    serves: WeightVersion | None  # the trainer version it serves; None: none (its start-up checkpoint)
    committed: WeightVersion | None  # syncd's committed version as it last heard it; None: none or no syncd
    committing: tuple[WeightVersion, ...]  # versions whose Commit this worker is applying
    written_at: float  # time.time() of the write

    def behind(self) -> bool:
        if self.committed is None or self.serves == self.committed:
            return False
        # A Commit of the committed version being applied on a worker that serves an earlier
        # trainer version is a refit in progress, not a worker left behind. A worker on its
        # start-up checkpoint stays behind until the install has landed.
        return self.serves is None or self.committed not in self.committing


def status_path(directory: str, member_id: str) -> Path:
    """Where the worker `member_id` publishes its `WorkerStatus`, in the API server's `directory`."""
    return Path(directory) / f"{member_id}.json"
