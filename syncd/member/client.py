"""The member side of syncd's protocol, used by trainer_svc ranks and generator_svc workers.

    client = MemberClient("syncd:8471", role=Role.GENERATOR, member_id="generator-0-0",
                          coords={"replica": 0, "tp": 0}, catalog=catalog)
    client.start(handler)            # handler(command) for JoinGroup, ExecutePlan, Verify, Commit, Abort
    client.report(cmd.refit_id, Phase.TRANSFERRED, bytes=n, checksums=sums)
    client.close()

Trainers pass `run_id` (the same for every rank of one training run) and announce each version
they hold; a client registers with the newest version it holds (trainer) or runs (generator: the
version of its last confirmed Commit, or the `weight_version` it was started with), so a
restarted syncd learns where every member stands. Registration and every heartbeat tell the
member syncd's committed version (`committed_version`), so a generator knows when it is behind.

Lifecycle: `start` spawns a session thread that registers (catalog hash first, the full catalog
only when syncd asks), then heartbeats every lease/3 while a Watch thread receives commands. When
the session ends (syncd restarted, lease lost, network down) it re-registers with exponential
backoff, forever, until `close`, which leaves syncd (its session ends at once, not when its lease
runs out).

Commands run on one handler thread in arrival order, so a handler may block (heartbeats go on).
`Abort` is delivered at once on its own thread, so it can interrupt a handler blocked in a
collective; the commands that arrive after it run once its handling is done, so an abort that
ends late (closing a communicator to a peer that is gone) never tears down the next refit, which
syncd may begin at once. A handler that raises is reported to syncd as a failure of the command's
phase.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping

import grpc

from syncd.api import MESSAGE_SIZE_OPTIONS, convert
from syncd.api import syncd_pb2 as pb
from syncd.api import syncd_pb2_grpc as pb_grpc
from syncd.auth import refusal
from syncd.commands import (
    Abort,
    Command,
    Commit,
    ExecutePlan,
    JoinGroup,
    MemberReport,
    Phase,
    ProgressReport,
    Verify,
)
from syncd.layout import Catalog
from syncd.layout.adapters import AdapterSpec, LoraSlots
from syncd.net import gpu_identity, host_identity, peer_gpu_identities
from syncd.vocabulary import Role
from syncd.weight_version import WeightVersion

log = logging.getLogger(__name__)

CommandHandler = Callable[[Command], None]

_PHASE_OF = {
    JoinGroup: Phase.JOINED,
    ExecutePlan: Phase.TRANSFERRED,
    Verify: Phase.VERIFIED,
    Commit: Phase.COMMITTED,
}
_RPC_TIMEOUT_S = 10.0
# A progress report is worth little once the next one is due: it never waits long for syncd.
_PROGRESS_TIMEOUT_S = 1.0
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.1, 5.0
# A stopping member waits at most this for syncd to take its Leave: past it, the lease ends the session.
_LEAVE_TIMEOUT_S = 2.0
# An abort handled for longer than this is logged: the commands after it wait for it.
_SLOW_ABORT_S = 30.0


class MemberClient:
    def __init__(
        self,
        target: str,
        *,
        role: Role,
        member_id: str,
        coords: dict[str, int],
        catalog: Catalog,
        device: str = "cpu",
        data_address: str = "",
        auth_token: str | None = None,
        run_id: str = "",
        weight_version: WeightVersion | None = None,
        receive_by_layer: bool = False,
        host_id: str | None = None,
        gpu_id: str | None = None,
        gpu_peers: tuple[str, ...] | None = None,
        adapter: AdapterSpec | None = None,
        lora_slots: LoraSlots | None = None,
    ) -> None:
        convert.role_to_pb(role)  # fail here, not in a background thread
        self.target = target
        self.role = role
        self.member_id = member_id
        self.coords = dict(coords)
        self.catalog = catalog
        self.device = device
        self.data_address = data_address
        self.run_id = run_id
        self.weight_version = weight_version
        self.receive_by_layer = receive_by_layer
        self.adapter = adapter  # a trainer of one named LoRA adapter (`syncd.layout.adapters`)
        self.lora_slots = lora_slots  # a generator that takes adapters into slots
        # Where this member runs; members of one host exchange bytes through shared memory.
        self.host_id = host_identity() if host_id is None else host_id
        # Which GPU it runs on, if any; members on the same one exchange bytes through CUDA IPC.
        self.gpu_id = gpu_identity(device) if gpu_id is None else gpu_id
        self.gpu_peers = peer_gpu_identities(device) if gpu_peers is None else gpu_peers  # read directly
        self._commit_versions: dict[str, WeightVersion] = {}  # refit id -> version of its Commit
        self.committed_version: WeightVersion | None = None  # syncd's, as of the last Register or Heartbeat
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        # Why syncd refused this member's token (UNAUTHENTICATED), once it has; it keeps trying.
        self.refusal: str | None = None
        self._channel = grpc.insecure_channel(target, options=MESSAGE_SIZE_OPTIONS)
        self._stub = pb_grpc.SyncdStub(self._channel)
        self._closed = threading.Event()
        self._registered = threading.Event()
        self._session_id = ""
        self._lease_s = 10.0
        self._catalog_pb: pb.Catalog | None = None
        # Commands in arrival order; an Abort's thread in its place (a barrier); None: stop.
        self._commands: queue.Queue[Command | threading.Thread | None] = queue.Queue()
        self._handler: CommandHandler | None = None
        self._threads: list[threading.Thread] = []

    # ---- public API ----

    def start(self, handler: CommandHandler) -> None:
        self._handler = handler
        for target, name in ((self._session_loop, "session"), (self._handle_loop, "handler")):
            t = threading.Thread(target=target, name=f"{self.member_id}-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def wait_registered(self, timeout: float = 30.0) -> bool:
        """True once a session is open (after `start`); False after `timeout`, or as soon as
        syncd refused this member's token (`refusal` says whether it had none or a wrong one)."""
        deadline = time.monotonic() + timeout
        while not self._registered.wait(max(0.0, min(0.1, deadline - time.monotonic()))):
            if self.refusal is not None or time.monotonic() >= deadline:
                return False
        return True

    @property
    def session_id(self) -> str:
        return self._session_id

    def report(
        self,
        refit_id: str,
        phase: Phase,
        *,
        ok: bool = True,
        error: str = "",
        bytes: int = 0,
        checksums: dict[str, str] | None = None,
        timings: dict[str, float] | None = None,
        address: str = "",
        delta_elements: int = 0,
        changed_elements: int = 0,
    ) -> None:
        """Answer a command with a `MemberReport`. Raises grpc.RpcError when syncd cannot be reached
        or refuses."""
        self._send_report(
            convert.report_to_pb(
                MemberReport(
                    self.member_id,
                    refit_id,
                    phase,
                    ok,
                    error,
                    bytes,
                    checksums or {},
                    timings or {},
                    address,
                    delta_elements,
                    changed_elements,
                )
            )
        )
        if phase == Phase.COMMITTED and refit_id in self._commit_versions:
            version = self._commit_versions.pop(refit_id)
            if ok:  # syncd recorded the decision before it sent Commit: this is the committed version
                self.weight_version = self.committed_version = version

    def report_progress(self, refit_id: str, links: Mapping[tuple[int, str], int]) -> None:
        """Tell syncd how many bytes of each link into this member arrived so far in refit
        `refit_id` (a `ProgressReport`): best effort, with a short timeout. Raises grpc.RpcError
        when syncd does not take it (a syncd without progress answers UNIMPLEMENTED)."""
        if not self._registered.is_set():
            return
        request = convert.progress_to_pb(ProgressReport(self.member_id, refit_id, links))
        request.session_id = self._session_id
        self._stub.Progress(request, timeout=_PROGRESS_TIMEOUT_S, metadata=self._metadata)

    @property
    def committing_versions(self) -> set[WeightVersion]:
        """Versions whose Commit this member received and has not yet confirmed."""
        return set(self._commit_versions.copy().values())  # copy: atomic under the GIL

    def announce_version(self, version: WeightVersion) -> None:
        """Trainers: weight version `version` is ready to be moved (auto-refit may start one)."""
        self.weight_version = version
        self._send_report(pb.ReportRequest(phase=pb.PHASE_ANNOUNCE, ok=True, weight_version=version))

    def version_status(self, version: WeightVersion) -> pb.VersionStatusResponse:
        """Trainers: what syncd says became of `version` of this member's run (the newest refit
        that moves it or a newer one, or why none started: `syncd.member.refit_outcomes`). Raises
        grpc.RpcError when syncd cannot be reached or knows no such session (it re-registers),
        RuntimeError while not registered or once closed."""
        if self._closed.is_set():
            raise RuntimeError(f"{self.member_id} has left syncd at {self.target}")
        if not self._registered.wait(_RPC_TIMEOUT_S):
            raise RuntimeError(f"{self.member_id} is not registered with syncd at {self.target}")
        request = pb.VersionStatusRequest(
            member_id=self.member_id, session_id=self._session_id, weight_version=version
        )
        return self._stub.VersionStatus(request, timeout=_RPC_TIMEOUT_S, metadata=self._metadata)

    def close(self, *, leave: bool = True) -> None:
        """Stop: leave syncd, then end the threads. `leave=False` stops as a crash would, silently
        (syncd ends the session when its lease runs out): what the lease-loss tests need."""
        session = self._session_id if self._registered.is_set() else ""
        self._closed.set()  # first: the session loop must not register again once syncd ends it
        if session and leave:
            self._leave(session)
        self._commands.put(None)
        self._channel.close()
        for t in self._threads:
            t.join(timeout=5)

    # ---- session ----

    def _leave(self, session_id: str) -> None:
        """Tell syncd this session ends, so a refit does not wait out its lease; best effort, as a
        syncd that cannot be reached (or one older than Leave) ends it when the lease runs out."""
        try:
            self._stub.Leave(
                pb.LeaveRequest(member_id=self.member_id, session_id=session_id),
                timeout=_LEAVE_TIMEOUT_S,
                metadata=self._metadata,
            )
            log.info("%s left syncd (session %s)", self.member_id, session_id[:8])
        except grpc.RpcError as e:
            log.info(
                "%s: could not leave syncd (%s %s); its session ends with its lease",
                self.member_id,
                e.code().name,
                e.details(),
            )

    def _send_report(self, request: pb.ReportRequest) -> None:
        if not self._registered.wait(_RPC_TIMEOUT_S):
            raise RuntimeError(f"{self.member_id} is not registered with syncd at {self.target}")
        request.member_id, request.session_id = self.member_id, self._session_id
        self._stub.Report(request, timeout=_RPC_TIMEOUT_S, metadata=self._metadata)

    def _session_loop(self) -> None:
        backoff = _BACKOFF_MIN_S
        while not self._closed.is_set():
            try:
                self._register()
                backoff = _BACKOFF_MIN_S
                self._serve()
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    self.refusal = refusal(token_given=bool(self._metadata))
                    log.error(
                        "%s: syncd at %s refused this member: %s; retrying in %.1fs",
                        self.member_id,
                        self.target,
                        self.refusal,
                        backoff,
                    )
                elif not self._closed.is_set():
                    log.warning(
                        "%s: syncd at %s: %s %s; retrying in %.1fs",
                        self.member_id,
                        self.target,
                        e.code().name,
                        e.details(),
                        backoff,
                    )
            except ValueError as e:  # closed channel during shutdown
                if not self._closed.is_set():
                    raise
                log.debug("%s: %s", self.member_id, e)
            self._registered.clear()
            self._closed.wait(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    def _register(self) -> None:
        request = pb.RegisterRequest(
            role=convert.role_to_pb(self.role),
            member_id=self.member_id,
            coords=self.coords,
            device=self.device,
            data_address=self.data_address,
            catalog_hash=self.catalog.content_hash,
            run_id=self.run_id,
            weight_version=self.weight_version,
            receive_by_layer=self.receive_by_layer,
            host_id=self.host_id,
            gpu_id=self.gpu_id,
            gpu_peers=list(self.gpu_peers),
            adapter=convert.adapter_to_pb(self.adapter),
            lora_slots=convert.lora_slots_to_pb(self.lora_slots),
        )
        response = self._stub.Register(request, timeout=_RPC_TIMEOUT_S, metadata=self._metadata)
        if response.catalog_required:
            if self._catalog_pb is None:
                self._catalog_pb = convert.catalog_to_pb(self.catalog)
            request.catalog.CopyFrom(self._catalog_pb)
            response = self._stub.Register(request, timeout=_RPC_TIMEOUT_S, metadata=self._metadata)
        self._session_id, self._lease_s = response.session_id, response.lease_seconds
        self._learn_committed(response)
        self.refusal = None
        self._registered.set()
        log.info("%s registered with syncd (session %s)", self.member_id, self._session_id[:8])

    def _serve(self) -> None:
        """Heartbeat until the session ends; the Watch stream runs on its own thread."""
        call = self._stub.Watch(
            pb.WatchRequest(member_id=self.member_id, session_id=self._session_id), metadata=self._metadata
        )
        watcher = threading.Thread(
            target=self._watch, args=(call,), name=f"{self.member_id}-watch", daemon=True
        )
        watcher.start()
        try:
            beat = pb.HeartbeatRequest(member_id=self.member_id, session_id=self._session_id)
            while watcher.is_alive() and not self._closed.wait(self._lease_s / 3):
                beaten = self._stub.Heartbeat(beat, timeout=_RPC_TIMEOUT_S, metadata=self._metadata)
                self._learn_committed(beaten)
        finally:
            call.cancel()
            watcher.join(timeout=5)

    def _learn_committed(self, response: pb.RegisterResponse | pb.HeartbeatResponse) -> None:
        has = response.HasField("committed_version")
        self.committed_version = WeightVersion(response.committed_version) if has else None

    def _watch(self, call: grpc.Future) -> None:
        try:
            for message in call:
                self._dispatch(convert.command_from_pb(message))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                log.warning("%s: Watch ended: %s %s", self.member_id, e.code().name, e.details())

    def _dispatch(self, command: Command) -> None:
        if isinstance(command, Commit) and not command.adapter:  # an adapter's version is not the base's
            self._commit_versions[command.refit_id] = command.weight_version
        if isinstance(command, Abort):
            aborting = threading.Thread(
                target=self._call_handler, args=(command,), name=f"{self.member_id}-abort", daemon=True
            )
            aborting.start()
            self._commands.put(aborting)
        else:
            self._commands.put(command)

    def _handle_loop(self) -> None:
        while (item := self._commands.get()) is not None:
            if isinstance(item, threading.Thread):  # what arrived after an Abort waits until it is handled
                item.join(_SLOW_ABORT_S)
                if item.is_alive():
                    log.warning(
                        "%s: an abort is still being handled after %.0f s; the next commands wait",
                        self.member_id,
                        _SLOW_ABORT_S,
                    )
                    item.join()
            else:
                self._call_handler(item)

    def _call_handler(self, command: Command) -> None:
        assert self._handler is not None
        try:
            self._handler(command)
        except Exception as e:
            log.exception("%s: handler failed on %s", self.member_id, type(command).__name__)
            phase = _PHASE_OF.get(type(command))
            if phase is not None:
                try:
                    self.report(command.refit_id, phase, ok=False, error=f"{type(e).__name__}: {e}")
                except (grpc.RpcError, RuntimeError, ValueError):
                    log.warning("%s: could not report the failure to syncd", self.member_id)
