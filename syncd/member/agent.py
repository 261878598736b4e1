"""The member side of the data plane: turns syncd's commands into transfers.

    agent = MemberAgent(client, endpoint, AgentSettings(host=my_ip, device="cuda:0"))
    client.start(agent)

`endpoint` is what the member exposes (a trainer rank's parameter views, a generator worker's
staging area); the agent is the same for both roles:

- JoinGroup: rank 0 creates the rendezvous address (gloo) or NCCL unique id, reports it
  (GROUP_ADDRESS) before it blocks in init; the others join with the address syncd relays; all
  report JOINED. One transport per PP stage, kept across refits until syncd regroups or aborts.
- ExecutePlan: one thread per stage group, all stages concurrently, each sending or receiving its
  buckets; then TRANSFERRED with bytes, per-unit checksums and timings.
- Verify / Commit: handed to the endpoint, then VERIFIED / COMMITTED. The endpoint hears `begin`
  before and `end` after its own transfer, so a trainer holds its weights still only that long.
- Abort (arrives on its own thread): cancel the transfer, abort every communicator so no peer
  waits for us, let the endpoint drop what it staged, report ABORTED.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from syncd.commands import Abort, Command, Commit, DeltaLinks, ExecutePlan, JoinGroup, Phase, Verify
from syncd.member.dataplane import (
    GcPause,
    GlooTransport,
    LoopCache,
    LoopOptions,
    TransferError,
    TransferStats,
    TransferTimeout,
    Transport,
    ipc_links,
    recv_buckets,
    send_buckets,
)
from syncd.member.dataplane.delta import DeltaStats, Diffs, Mirror, recv_with_deltas, send_with_deltas
from syncd.member.dataplane.ipc_links import IpcLinks
from syncd.member.dataplane.landing_fault import LandingFault, armed, fault_file_from_env
from syncd.member.dataplane.prepared import ReceiveSink
from syncd.member.dataplane.relay import relay_buckets, relay_with_deltas
from syncd.member.dataplane.shm import ShmTransport, sweep_orphans
from syncd.plan.transports import ipc_refusal
from syncd.plan.types import Bucket
from syncd.vocabulary import Backend, LinkTransport
from syncd.weight_version import WeightVersion

log = logging.getLogger(__name__)


class Endpoint(Protocol):
    """What a member exposes to the data plane."""

    def begin(
        self, refit_id: str, weight_version: WeightVersion, buckets: Sequence[Bucket]
    ) -> Mapping[str, torch.Tensor] | ReceiveSink:
        """Tensors (views in the catalog's shapes) to send `buckets` from or receive them into, or
        a receiver that takes each arrived bucket itself (`ReceiveSink`)."""
        ...

    def end(self, refit_id: str, ok: bool) -> None:
        """This member's transfer is over: all its buckets moved (`ok`) or it failed. A trainer may
        step again; a generator knows what it staged. A sender with delta refits on hears it on
        Verify (or the refit's abort), once its mirror took what it sent (`_update_mirror`)."""
        ...

    def verify(self, refit_id: str) -> None: ...

    def commit(self, refit_id: str, weight_version: WeightVersion, timeout_s: float) -> None:
        """Make `weight_version` live within `timeout_s` (syncd's deadline) or raise."""
        ...

    def abort(self) -> None: ...

    # Optional: `received_delta(refit_id, changed)` hears, after a delta transfer, which of its
    # tensors changed (the rest hold the base version), so a generator installs only those.


class Reporter(Protocol):
    """What the agent needs of its client (`MemberClient`): its id, and answering a command."""

    @property
    def member_id(self) -> str: ...

    def report(
        self,
        refit_id: str,
        phase: str,
        *,
        ok: bool = True,
        error: str = "",
        bytes: int = 0,
        checksums: dict[str, str] | None = None,
        timings: dict[str, float] | None = None,
        address: str = "",
        delta_elements: int = 0,
        changed_elements: int = 0,
    ) -> None: ...


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


@dataclass(frozen=True)
class _MirrorUpdate:
    """A sender's transfer that succeeded, whose mirror takes what it sent (`Diffs.commit`) once
    every member's transfer is done (syncd's Verify): until then its endpoint's transfer has not
    ended, so the weights stay as they were sent (the trainer's optimizer step waits)."""

    refit_id: str
    version: WeightVersion
    diffs: Diffs
    tensors: Mapping[str, torch.Tensor]


@dataclass
class _Group:
    group_id: str
    members: tuple[str, ...]
    # None: a CUDA IPC group (its members all share memory), without NCCL (`ipc_links`).
    transport: Transport | None
    cache: LoopCache  # what the loops over `transport` keep between refits; dropped with it
    ipc: IpcLinks | None = None  # the links to members this member shares memory with (CUDA IPC)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self.ipc is not None:
            self.ipc.close()


def _naming_peer(error: BaseException, members: Sequence[str]) -> BaseException:
    """A transport error with the member at the other end named, so that syncd's abort says which
    member was slow, stuck or gone (the transport knows only its group rank)."""
    peer = getattr(error, "peer", None)
    if not isinstance(error, TransferError) or peer is None or not 0 <= peer < len(members):
        return error
    what = "is slow or stuck" if isinstance(error, TransferTimeout) else "failed or is gone"
    return TransferError(f"{error}: {members[peer]} {what}", peer)


class MemberAgent:
    def __init__(self, client: Reporter, endpoint: Endpoint, settings: AgentSettings = AgentSettings()):
        self._client, self._endpoint, self._settings = client, endpoint, settings
        self._groups: dict[int, _Group] = {}
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._gc_pause = GcPause() if settings.pause_gc else None
        self.mirror: Mirror | None = None  # senders, while delta refits are on: what they last sent
        self._mirror_update: _MirrorUpdate | None = None  # a sender's, from its transfer to Verify

    @property
    def member_id(self) -> str:
        return self._client.member_id

    def __call__(self, command: Command) -> None:
        if isinstance(command, JoinGroup):
            self._join(command)
        elif isinstance(command, ExecutePlan):
            self._execute(command)
        elif isinstance(command, Verify):
            self._endpoint.verify(command.refit_id)
            self._client.report(command.refit_id, Phase.VERIFIED)
            self._update_mirror(command.refit_id)
        elif isinstance(command, Commit):
            self._endpoint.commit(command.refit_id, command.weight_version, command.timeout_s)
            self._client.report(command.refit_id, Phase.COMMITTED)
        elif isinstance(command, Abort):
            self._abort(command)

    def _join(self, cmd: JoinGroup) -> None:
        self._close_group(cmd.stage)
        timeout = cmd.timeout_s
        t0 = time.perf_counter()
        transport: Transport | None
        ipc: IpcLinks | None = None
        if cmd.backend == Backend.NCCL:
            from syncd.member.dataplane.nccl import NcclTransport

            device = torch.device(self._settings.device)
            # syncd decides per group (`syncd.plan.transports.ipc_group`): every link CUDA IPC and
            # no NCCL communicator, or NCCL on every link.
            others = [r for r in range(cmd.world_size) if r != cmd.rank]
            over_ipc = bool(cmd.links) and all(cmd.links[r] == LinkTransport.CUDA_IPC for r in others)
            create = ipc_links.create_address if over_ipc else NcclTransport.create_address
            address = create() if cmd.rank == 0 else cmd.address
            if cmd.rank == 0:
                self._client.report(cmd.refit_id, Phase.GROUP_ADDRESS, address=address)
            if over_ipc:
                transport = None
                left = timeout - (time.perf_counter() - t0)
                ipc = IpcLinks(ipc_links.meet(address, cmd.rank, others, left), device)
            else:
                transport = NcclTransport.connect(address, cmd.rank, cmd.world_size, device, timeout)
        elif cmd.backend == Backend.GLOO:
            store = None
            address = cmd.address
            if cmd.rank == 0:
                address, store = GlooTransport.create_address(self._settings.host, cmd.world_size, timeout)
                self._client.report(cmd.refit_id, Phase.GROUP_ADDRESS, address=address)
            transport = GlooTransport.connect(
                address, cmd.rank, cmd.world_size, cmd.group_id, timeout, store, bind_host=self._settings.host
            )
            local = [r for r, link in enumerate(cmd.links) if link == LinkTransport.SHM and r != cmd.rank]
            if local:  # peers on this host: shared memory to them, gloo to the others
                sweep_orphans()  # what members killed in an earlier refit left
                transport = ShmTransport(transport, local, cmd.group_id, timeout)
        else:
            known = " or ".join(repr(str(b)) for b in Backend)
            raise ValueError(f"unknown data-plane backend {cmd.backend!r}; expected {known}")
        with self._lock:
            # Over shared memory the loops' staging is the transport's: sends from it copy nothing.
            allocate = transport.allocate if isinstance(transport, ShmTransport) else None
            self._groups[cmd.stage] = _Group(cmd.group_id, cmd.members, transport, LoopCache(allocate), ipc)
        self._client.report(cmd.refit_id, Phase.JOINED, timings={"join_s": time.perf_counter() - t0})
        shm = sorted(transport.local_peers) if isinstance(transport, ShmTransport) else []
        log.info(
            "%s joined %s as rank %d/%d%s%s",
            self.member_id,
            cmd.group_id,
            cmd.rank,
            cmd.world_size,
            f", shared memory to ranks {shm}" if shm else "",
            f", CUDA IPC to ranks {sorted(ipc.peers)}" if ipc is not None else "",
        )

    def _execute(self, cmd: ExecutePlan) -> None:
        self._drop_mirror_update()  # an earlier refit's that got no Verify (it failed elsewhere)
        self._cancel.clear()
        tensors = self._endpoint.begin(cmd.refit_id, cmd.weight_version, cmd.buckets)
        update: _MirrorUpdate | None = None
        ok = False
        try:
            update = self._transfer(cmd, tensors)
            ok = True
        finally:
            self._end_shared_memory()
            if update is None:
                self._endpoint.end(cmd.refit_id, ok)
        if update is not None:  # the weights stay held until the mirror took them, on Verify
            with self._lock:
                self._mirror_update = update
            if self._cancel.is_set():  # aborted since the report: `_abort` may have looked already
                self._drop_mirror_update()

    def _update_mirror(self, refit_id: str) -> None:
        """Verify: every member's transfer is done, so the mirror's copy (a write of every dense
        byte) no longer competes with the transfer for the memory and cores; it overlaps the
        generators' verification and install instead. This thread runs it, so this member's
        Commit confirmation, and the next refit's comparisons, come after it; then the weights are
        released (`Endpoint.end`). A failure leaves the mirror's `version` None: no delta from it
        until a full refit refills it."""
        with self._lock:
            update, self._mirror_update = self._mirror_update, None
        if update is None:
            return
        try:
            if update.refit_id == refit_id:
                update.diffs.commit(update.tensors)
                update.diffs.mirror.version = update.version
        finally:
            self._endpoint.end(update.refit_id, True)

    def _drop_mirror_update(self) -> None:
        """The refit failed after this sender's transfer: its mirror keeps the base (nothing was
        written into it), still marked between versions (`version` None), and the weights are
        released."""
        with self._lock:
            update, self._mirror_update = self._mirror_update, None
        if update is not None:
            self._endpoint.end(update.refit_id, True)

    def _end_shared_memory(self) -> None:
        """The transfer ended: no segment name of this refit stays in /dev/shm, ours or those of a
        local peer that died before it could unlink its own."""
        with self._lock:
            transports = [g.transport for g in self._groups.values()]
        shared = [t for t in transports if isinstance(t, ShmTransport)]
        for transport in shared:
            transport.end_refit()
        if shared:
            sweep_orphans()

    def _delta_part(self, cmd: ExecutePlan) -> tuple[DeltaLinks | None, Diffs | None]:
        """This member's part in a delta refit: the delta links when it sends or receives deltas
        (a sender sends through its mirror whenever delta refits are on), and a sender's
        comparisons with its mirror, which must hold the base its delta receivers hold."""
        d = cmd.delta
        if d is None:
            return None, None
        if not any(b.src == self.member_id and b.relay is None for b in cmd.buckets):  # relays: receivers
            return (d if self.member_id in d.dsts else None), None
        if self.mirror is None:
            self.mirror = Mirror()
        if any(b.dst in d.dsts for b in cmd.buckets) and self.mirror.version != d.base:
            raise RuntimeError(
                f"{self.member_id} holds what it sent of version {self.mirror.version}, "
                f"not of the delta base {d.base}"
            )
        self.mirror.version = None  # until this transfer completes, the mirror is between versions
        return d, Diffs(self.mirror)

    def _transfer(
        self, cmd: ExecutePlan, tensors: Mapping[str, torch.Tensor] | ReceiveSink
    ) -> _MirrorUpdate | None:
        """Runs this member's part of the plan and reports it; a sender with delta refits on
        returns its mirror's update, for Verify."""
        delta, diffs = self._delta_part(cmd)
        fault = armed(self._settings.landing_fault_file)
        if fault is not None:
            log.warning("%s: test fault %s armed for refit %s", self.member_id, fault, cmd.refit_id)
        per_stage: dict[int, list[Bucket]] = defaultdict(list)
        for b in cmd.buckets:
            per_stage[b.stage].append(b)
        groups = {g.stage: g for g in cmd.groups}
        results: dict[int, TransferStats | BaseException] = {}
        threads = []
        for stage, buckets in per_stage.items():
            group = self._groups.get(stage)
            expected = groups.get(stage)
            if group is None or (expected is not None and expected.group_id != group.group_id):
                raise RuntimeError(f"{self.member_id} has not joined the group of stage {stage}")
            # Each wait of the loops ends within the stall timeout: a slow peer is named, not waited for.
            timeout_s = min(cmd.timeout_s, cmd.stall_timeout_s) if cmd.stall_timeout_s > 0 else cmd.timeout_s
            t = threading.Thread(
                target=self._run_stage,
                args=(cmd, group, buckets, tensors, results, stage, timeout_s, delta, diffs, fault),
                name=f"{self.member_id}-stage{stage}",
            )
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        errors = [r for r in results.values() if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        checksums, total, timings, elements, changed = {}, 0, {}, 0, 0
        touched: set[str] = set()
        for stage, stats in results.items():
            assert isinstance(stats, TransferStats)  # the failures were raised above
            checksums.update(stats.checksums)
            total += stats.bytes
            timings[f"stage{stage}_s"] = stats.seconds
            if isinstance(stats, DeltaStats):
                elements, changed = elements + stats.elements, changed + stats.changed
                touched |= stats.touched
        timings["transfer_s"] = max(timings.values(), default=0.0)
        if diffs is None and delta is not None and hasattr(self._endpoint, "received_delta"):
            self._endpoint.received_delta(cmd.refit_id, frozenset(touched))
        self._client.report(
            cmd.refit_id,
            Phase.TRANSFERRED,
            bytes=total,
            checksums=checksums,
            timings=timings,
            delta_elements=elements,
            changed_elements=changed,
        )
        if diffs is None:
            return None
        assert isinstance(tensors, Mapping)  # diffs are a sender's, and a sender names its tensors
        return _MirrorUpdate(cmd.refit_id, cmd.weight_version, diffs, tensors)

    def _run_stage(
        self,
        cmd: ExecutePlan,
        group: _Group,
        buckets: list[Bucket],
        tensors,
        results: dict[int, TransferStats | BaseException],
        stage: int,
        timeout_s: float,
        delta: DeltaLinks | None,
        diffs: Diffs | None,
        fault: LandingFault | None,
    ) -> None:
        ranks = {m: i for i, m in enumerate(group.members)}
        relaying = any(b.relay is not None and b.src == self.member_id for b in buckets)  # fan-out
        # A relay is a receiver first: its receives wait the stall timeout, only its forwards
        # twice (its own relay buckets sort before a trainer's, so buckets[0] may be one).
        sending = not relaying and buckets[0].src == self.member_id
        # Sends wait twice the stall timeout: a blocked sender is its receiver's victim, and the
        # member starving on a receive names the stuck one first (`syncd.daemon.survivors`).
        options = LoopOptions(
            2 * timeout_s if sending else timeout_s,
            self._settings.in_flight,
            gc_pause=self._gc_pause,
            landing_fault=fault,
        )
        cancel, cache, transport = self._cancel, group.cache, group.transport
        try:
            if group.ipc is not None:  # a CUDA IPC group: no network transport
                results[stage] = self._run_ipc(cmd, group, buckets, tensors, ranks, sending, timeout_s)
                return
            assert transport is not None  # only CUDA IPC groups have none
            if relaying and delta is not None:  # `_delta_part`: a relay gets delta links as a receiver
                results[stage] = relay_with_deltas(
                    buckets,
                    self.member_id,
                    tensors,
                    transport,
                    ranks,
                    delta,
                    options,
                    cancel=cancel,
                    cache=cache,
                    forward_timeout_s=2 * timeout_s,
                )
            elif relaying:
                results[stage] = relay_buckets(
                    buckets,
                    self.member_id,
                    tensors,
                    transport,
                    ranks,
                    options,
                    cancel=cancel,
                    cache=cache,
                    forward_timeout_s=2 * timeout_s,
                )
            elif delta is None:
                loop = send_buckets if sending else recv_buckets
                results[stage] = loop(buckets, tensors, transport, ranks, options, cancel=cancel, cache=cache)
            elif sending:
                assert diffs is not None  # `_delta_part` gives every sender its comparisons
                results[stage] = send_with_deltas(
                    buckets, tensors, transport, ranks, delta, diffs, options, cancel=cancel, cache=cache
                )
            else:
                results[stage] = recv_with_deltas(
                    buckets, tensors, transport, ranks, delta, options, cancel=cancel, cache=cache
                )
        except BaseException as e:  # noqa: BLE001 - a stage thread's failure goes to `results`, read after join
            log.warning("%s: stage %d transfer failed: %s", self.member_id, stage, e)
            self._close_group(stage)  # unblock our peers: they fail fast instead of timing out
            results[stage] = _naming_peer(e, group.members)

    def _run_ipc(
        self,
        cmd: ExecutePlan,
        group: _Group,
        buckets: list[Bucket],
        tensors,
        ranks: Mapping[str, int],
        sending: bool,
        timeout_s: float,
    ) -> TransferStats:
        """This member's buckets in a CUDA IPC group: all of them over the links syncd named
        (`ipc_links`); one CUDA IPC cannot carry has no other way there."""
        assert group.ipc is not None
        refused = [b for b in buckets if (b.stage, b.src, b.dst) not in cmd.ipc_links]
        if refused:
            links = sorted({f"{b.src} -> {b.dst}" for b in refused})
            raise TransferError(
                f"links {', '.join(links)} cannot go through CUDA IPC "
                f"({ipc_refusal(refused) or 'not chosen by syncd'}), and group {group.group_id} has no "
                "NCCL communicator: it is a CUDA IPC group"
            )
        if not isinstance(tensors, Mapping):
            raise TransferError(f"{self.member_id} installs as buckets arrive; CUDA IPC copies into staging")
        if sending:
            return group.ipc.send(buckets, tensors, ranks, cmd.refit_id, 2 * timeout_s)
        return group.ipc.receive(buckets, tensors, ranks, cmd.refit_id, timeout_s)

    def _abort(self, cmd: Abort) -> None:
        log.warning("%s: abort %s: %s", self.member_id, cmd.refit_id, cmd.reason)
        self._cancel.set()
        for stage in list(self._groups):
            self._close_group(stage)
        sweep_orphans()  # a local peer killed mid-refit left its segments' names
        self._drop_mirror_update()
        self._endpoint.abort()
        self._client.report(cmd.refit_id, Phase.ABORTED)

    def _close_group(self, stage: int) -> None:
        with self._lock:
            group = self._groups.pop(stage, None)
        if group is not None:
            group.close()

    def close(self) -> None:
        self._drop_mirror_update()
        for stage in list(self._groups):
            self._close_group(stage)
