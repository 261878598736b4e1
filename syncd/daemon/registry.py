"""Members, their catalogs, leases and command queues.

Lifecycle of a member: `register` (hash first; the full catalog only when syncd lacks it) opens a
session; `heartbeat` renews its lease; `leave` ends it when the member stops; `expire` (called by
the daemon's reaper) ends sessions whose lease ran out. A member id with a live lease is not taken
over: a restarted member that did not leave registers again once its old lease ran out (its client
retries by itself). Ending a session closes its command queue, which ends its Watch stream, and
tells `on_lost` listeners; a new session tells `on_registered` listeners.

Member ids are Kubernetes names (RFC 1123 subdomains: lowercase letters, digits, '-' and '.',
at most 253 characters), so they are safe in logs, metrics and URLs.

Catalogs are kept by content hash for the daemon's lifetime: identical layouts are stored once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

from syncd.commands import Command
from syncd.daemon.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from syncd.layout import CanonicalTensor, Catalog, LocalTensor
from syncd.layout.adapters import AdapterSpec, LoraSlots
from syncd.vocabulary import Role
from syncd.weight_version import WeightVersion, parse_weight_version

log = logging.getLogger(__name__)

ROLES = tuple(Role)
# Display order of mesh dims (protobuf maps are unordered); other dims follow alphabetically.
DIM_ORDER = ("replica", "pp", "dp", "ep", "tp")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_NAME_MAX = 253
_RUN_ID = re.compile(r"[A-Za-z0-9._:-]{0,128}")


@dataclass(frozen=True)
class Member:
    member_id: str
    role: Role
    coords: Mapping[str, int]
    device: str
    data_address: str
    catalog_hash: str
    session_id: str
    registered_at: float
    run_id: str = ""  # trainers: the training run
    weight_version: WeightVersion | None = None  # what it held or served when it registered
    receive_by_layer: bool = False  # generators installing while they receive (see the proto)
    host_id: str = ""  # where it runs (`syncd.net.host_identity`); empty: unknown
    gpu_id: str = ""  # the UUID of its GPU (`syncd.net.gpu_identity`); empty: none or unknown
    gpu_peers: tuple[str, ...] = ()  # the GPUs its GPU reads directly (`syncd.net.peer_gpu_identities`)
    # Trainers of one named LoRA adapter (`syncd.layout.adapters`): kept out of base refits.
    adapter: AdapterSpec | None = None
    lora_slots: LoraSlots | None = None  # generators that take adapters into slots

    @property
    def stage(self) -> int:
        """Trainer pipeline stage (the `pp` coordinate); 0 when the mesh has no pp dim."""
        return int(self.coords.get("pp", 0))


@dataclass
class _Session:
    member: Member
    lease_deadline: float
    commands: queue.Queue[Command | None] = field(default_factory=queue.Queue)
    watches: int = 0  # open Watch streams


@dataclass(frozen=True)
class Limits:
    """Bounds on what one member may make syncd hold or compute (documented in docs/syncd.md)."""

    catalog_entries: int = 1_000_000  # canonical tensors + local tensors + pieces
    tensor_elements: int = 1 << 40
    watch_streams: int = 2  # per session


@dataclass(frozen=True)
class Registration:
    """`catalog_required`: syncd lacks the catalog and registered nothing; send it in full."""

    catalog_required: bool
    member: Member | None = None


LostListener = Callable[[Member, str], None]
RegisteredListener = Callable[[Member], None]


class Registry:
    def __init__(self, lease_seconds: float, limits: Limits = Limits()) -> None:
        self.lease_seconds = lease_seconds
        self.limits = limits
        self._lock = threading.Lock()
        self._catalogs: dict[str, Catalog] = {}
        self._sessions: dict[str, _Session] = {}
        self._listeners: list[LostListener] = []
        self._registered_listeners: list[RegisteredListener] = []

    def on_lost(self, listener: LostListener) -> None:
        self._listeners.append(listener)

    def on_registered(self, listener: RegisteredListener) -> None:
        self._registered_listeners.append(listener)

    def register(
        self,
        *,
        role: Role,
        member_id: str,
        coords: Mapping[str, int],
        device: str,
        data_address: str,
        catalog_hash: str,
        catalog: Catalog | None,
        run_id: str = "",
        weight_version: int | None = None,
        receive_by_layer: bool = False,
        host_id: str = "",
        gpu_id: str = "",
        gpu_peers: tuple[str, ...] = (),
        adapter: AdapterSpec | None = None,
        lora_slots: LoraSlots | None = None,
    ) -> Registration:
        """Validate and open a session; raises InvalidArgument / AlreadyExists and changes nothing."""
        check_member_id(member_id)
        if not _RUN_ID.fullmatch(run_id):
            raise InvalidArgument(
                f"member {member_id}: run_id {run_id[:64]!r} is not 0-128 characters of "
                "letters, digits, '.', '_', ':' or '-'"
            )
        negative = {d: v for d, v in coords.items() if v < 0}
        if negative:
            raise InvalidArgument(
                f"member {member_id}: coords {negative} are negative; mesh coordinates count from 0"
            )
        if weight_version is not None:
            weight_version = check_weight_version(member_id, weight_version)
        if role == Role.TRAINER and receive_by_layer:
            raise InvalidArgument(
                f"trainer {member_id}: receive_by_layer is for generators (trainers only send)"
            )
        if adapter is not None and role != Role.TRAINER:
            raise InvalidArgument(f"{role} {member_id}: only trainers send an adapter")
        if lora_slots is not None and role != Role.GENERATOR:
            raise InvalidArgument(f"{role} {member_id}: only generators take adapters into slots")
        if role == Role.TRAINER and "pp" not in coords:
            raise InvalidArgument(f"trainer {member_id}: coords {dict(coords)} lack the 'pp' dim")
        if catalog is not None:
            _check_catalog(member_id, catalog, catalog_hash, self.limits)
        with self._lock:
            if catalog is None and catalog_hash not in self._catalogs:
                return Registration(catalog_required=True)
            self._check_live(member_id)
            self._check_coords(role, member_id, coords, adapter)
            if catalog is not None:
                self._catalogs.setdefault(catalog_hash, catalog)
            member = Member(
                member_id,
                role,
                _ordered(coords),
                device,
                data_address,
                catalog_hash,
                uuid.uuid4().hex,
                time.time(),
                run_id,
                weight_version,
                receive_by_layer,
                host_id,
                gpu_id,
                tuple(gpu_peers),
                adapter,
                lora_slots,
            )
            old = self._sessions.get(member_id)
            self._sessions[member_id] = _Session(member, time.monotonic() + self.lease_seconds)
        if old is not None:
            self._end(old, "its lease ran out before it registered again")
        log.info(
            "registered %s %s coords=%s catalog=%s run=%r version=%s",
            role,
            member_id,
            dict(coords),
            catalog_hash[:19],
            run_id,
            weight_version,
        )
        for listener in self._registered_listeners:
            listener(member)
        return Registration(catalog_required=False, member=member)

    def _check_live(self, member_id: str) -> None:
        s = self._sessions.get(member_id)
        if s is not None:
            left = s.lease_deadline - time.monotonic()
            if left >= 0:
                raise AlreadyExists(
                    f"member id {member_id} is held by a live session (its lease ends in {left:.1f}s unless "
                    "renewed); a restarted member registers again once that lease ran out"
                )

    def _check_coords(
        self, role: Role, member_id: str, coords: Mapping[str, int], adapter: AdapterSpec | None
    ) -> None:
        """Coordinates are unique per role, and for an adapter's trainers per adapter."""
        name = adapter.name if adapter is not None else None
        for s in self._sessions.values():
            m = s.member
            same_kind = m.role == role and (m.adapter.name if m.adapter is not None else None) == name
            if same_kind and m.member_id != member_id and dict(m.coords) == dict(coords):
                raise AlreadyExists(
                    f"{role} coordinates {dict(coords)} are already held by live member {m.member_id}; "
                    f"{member_id} cannot claim them"
                )

    def heartbeat(self, member_id: str, session_id: str) -> None:
        with self._lock:
            self._session(member_id, session_id).lease_deadline = time.monotonic() + self.lease_seconds

    def leave(self, member_id: str, session_id: str) -> None:
        """The member stops: its session ends now, as `expire` would end it (a refit it takes part
        in aborts), and its id is free to register again. Raises NotFound for a session that ended."""
        with self._lock:
            s = self._session(member_id, session_id)
            del self._sessions[member_id]
        log.info("member %s left", member_id)
        self._tell_lost(s, "it left (its process is stopping)")

    @contextlib.contextmanager
    def watching(self, member_id: str, session_id: str) -> Iterator[queue.Queue[Command | None]]:
        """Count an open Watch stream of the session (each holds a gRPC worker thread)."""
        with self._lock:
            s = self._session(member_id, session_id)
            if s.watches >= self.limits.watch_streams:
                raise ResourceExhausted(
                    f"member {member_id} already has {s.watches} Watch streams open on this session "
                    f"(limit {self.limits.watch_streams})"
                )
            s.watches += 1
        try:
            yield s.commands
        finally:
            with self._lock:
                s.watches -= 1

    def member(self, member_id: str, session_id: str) -> Member:
        with self._lock:
            return self._session(member_id, session_id).member

    def _session(self, member_id: str, session_id: str) -> _Session:
        s = self._sessions.get(member_id)
        if s is None or s.member.session_id != session_id:
            raise NotFound(f"member {member_id} has no session {session_id[:8]}: register again")
        return s

    def send(self, member_id: str, command: Command) -> bool:
        """Queue `command` for the member's Watch stream; False if it has no session."""
        with self._lock:
            s = self._sessions.get(member_id)
        if s is None:
            return False
        s.commands.put(command)
        return True

    def members(self) -> list[Member]:
        """The members of base refits: every live member but the trainers of named adapters."""
        return [m for m in self.all_members() if m.adapter is None]

    def adapter_senders(self, name: str | None = None) -> list[Member]:
        """The live trainers of adapter `name` (of every adapter when None)."""
        return [m for m in self.all_members() if m.adapter is not None and name in (None, m.adapter.name)]

    def all_members(self) -> list[Member]:
        with self._lock:
            return sorted((s.member for s in self._sessions.values()), key=lambda m: (m.role, m.member_id))

    def catalog(self, catalog_hash: str) -> Catalog:
        with self._lock:
            return self._catalogs[catalog_hash]

    def set_weight_version(self, member_id: str, version: WeightVersion) -> None:
        """The member confirmed it now holds or serves `version`."""
        with self._lock:
            s = self._sessions.get(member_id)
            if s is not None:
                s.member = replace(s.member, weight_version=version)

    def known_catalog(self, catalog_hash: str) -> Catalog | None:
        with self._lock:
            return self._catalogs.get(catalog_hash)

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            gone = [s for s in self._sessions.values() if s.lease_deadline < now]
            for s in gone:
                del self._sessions[s.member.member_id]
        for s in gone:
            self._end(s, f"lease expired (no heartbeat for {self.lease_seconds:g}s)")

    def close_all(self) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for s in sessions:
            s.commands.put(None)

    def _end(self, s: _Session, reason: str) -> None:
        log.warning("member %s lost: %s", s.member.member_id, reason)
        self._tell_lost(s, reason)

    def _tell_lost(self, s: _Session, reason: str) -> None:
        """The session ended (`reason`): its Watch stream ends, and the listeners hear of it."""
        s.commands.put(None)
        for listener in self._listeners:
            listener(s.member, reason)


def check_member_id(member_id: str) -> None:
    """Raises InvalidArgument unless `member_id` is a Kubernetes name (RFC 1123 subdomain)."""
    if len(member_id) > _NAME_MAX or not _NAME.fullmatch(member_id):
        shown = repr(member_id[:64]) + (f"... ({len(member_id)} characters)" if len(member_id) > 64 else "")
        raise InvalidArgument(
            f"member_id {shown} is not a Kubernetes name: 1-{_NAME_MAX} lowercase letters, digits, '-' "
            "and '.', starting and ending with a letter or digit"
        )


def check_weight_version(member_id: str, version: int) -> WeightVersion:
    """`version` as a weight version; raises InvalidArgument naming `member_id` unless it is one."""
    try:
        return parse_weight_version(version)
    except ValueError as e:
        raise InvalidArgument(f"member {member_id}: {e}") from None


def _ordered(coords: Mapping[str, int]) -> dict[str, int]:
    rank = {d: i for i, d in enumerate(DIM_ORDER)}
    return {d: coords[d] for d in sorted(coords, key=lambda d: (rank.get(d, len(rank)), d))}


def _check_catalog(member_id: str, catalog: Catalog, claimed_hash: str, limits: Limits) -> None:
    entries = len(catalog.canonical) + len(catalog.tensors) + sum(len(t.pieces) for t in catalog.tensors)
    if entries > limits.catalog_entries:
        raise InvalidArgument(
            f"catalog of {member_id}: {entries} tensors and pieces, more than the limit "
            f"{limits.catalog_entries} (max_catalog_entries)"
        )
    every: tuple[CanonicalTensor | LocalTensor, ...] = (*catalog.canonical, *catalog.tensors)
    for t in every:
        elements = math.prod(t.shape)
        if elements > limits.tensor_elements:
            raise InvalidArgument(
                f"catalog of {member_id}: tensor {t.name[:200]} has {elements} elements, "
                f"more than the limit {limits.tensor_elements} (max_tensor_elements)"
            )
    try:
        catalog.validate()
    except ValueError as e:
        raise InvalidArgument(f"catalog of {member_id}: {e}") from None
    if catalog.content_hash != claimed_hash:
        raise InvalidArgument(
            f"catalog of {member_id}: claimed hash {claimed_hash} but its content hashes to "
            f"{catalog.content_hash}"
        )
