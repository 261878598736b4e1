"""Data-plane transports: point-to-point byte buffers inside one per-stage group.

The interface is deliberately tiny (isend, irecv, wait with a timeout, abort) so NCCL (nccl4py on
GPUs, `syncd.member.dataplane.nccl`) and gloo (CPU) are interchangeable under the same executor.

Group setup follows syncd's negotiation: rank 0 calls `create_address()` and reports the address
through syncd before it blocks in `connect()`; the others `connect()` with the relayed address.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

# `GlooTransport.abort`: a tag no transfer uses, and how long its receive waits before gloo breaks
# the group.
_BREAK_TAG = 0x7FFF_FFFF
_BREAK_WAIT = datetime.timedelta(milliseconds=1)


class TransferError(RuntimeError):
    """A send or receive failed: the peer died, closed the group, or the group was aborted.
    `peer`: the group rank at the other end, where the transport knows it."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class TransferTimeout(TransferError, TimeoutError):
    """A send or receive did not complete in time."""


class ConcurrentUse(RuntimeError):
    """Two threads entered one communicator at once."""


class OneCaller:
    """Admits one thread at a time into a communicator's calls, and raises for a second instead of
    making it wait. NCCL communicators are not thread-safe: a call from a second thread while the
    first is still in progress fails (`InvalidArgument`, with NCCL's "Attempt to use communicator
    before the previous operation returned ncclSuccess"), and two threads' sends could also
    interleave out of the order the plan's deadlock freedom rests on. A lock would hide that
    design error and reorder the sends, so the guard names both threads instead. (`abort` is
    exempt: it is how another thread ends a blocked transfer.)"""

    def __init__(self, what: str) -> None:
        self._what = what
        self._lock = threading.Lock()
        self._holder: str | None = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        me = threading.current_thread().name
        if not self._lock.acquire(blocking=False):
            raise ConcurrentUse(
                f"{self._what} is in use by thread {self._holder!r} and thread {me!r} called it too: "
                "a communicator takes calls from one thread at a time (post sends to several peers "
                "in one call, e.g. NcclTransport.isend_group)"
            )
        self._holder = me
        try:
            yield
        finally:
            self._holder = None
            self._lock.release()


class Handle(Protocol):
    def wait(self, timeout_s: float) -> None:
        """Block the host until the transfer completed (raises TransferError/TransferTimeout)."""

    def fence(self, timeout_s: float) -> None:
        """Order work enqueued later on the current stream after the transfer. On GPUs this is a
        stream wait and the host runs on; on CPU, where there are no streams, it is `wait`."""


class Transport(Protocol):
    rank: int
    world_size: int

    def isend(self, buf: torch.Tensor, peer: int) -> Handle: ...
    def irecv(self, buf: torch.Tensor, peer: int) -> Handle: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class GroupSender(Protocol):
    """A transport that posts sends to several peers as one operation (NCCL's group call)."""

    def isend_group(self, sends: Sequence[tuple[torch.Tensor, int]]) -> Sequence[Handle]: ...


class _GlooHandle:
    """One posted send or receive. Its wait runs gloo's on a thread of its own, so that an abort
    ends the wait at once (`interrupt`): gloo wakes no wait on a send already in flight when it
    breaks the group (measured, torch 2.13: across lab hosts, a send to a cut-off host waited out
    its whole timeout), and its sockets close at the abort, so nothing lands after it."""

    def __init__(self, work, what: str, peer: int, aborted: threading.Event):
        self._work, self._what, self._peer = work, what, peer
        self._aborted = aborted  # the transport's: set once its group was aborted
        self._woken = threading.Event()  # gloo's wait returned, or the group was aborted
        self._done = False

    def interrupt(self) -> None:
        """The group was aborted: a wait in progress raises now."""
        self._woken.set()

    def release(self) -> None:
        """Drop the gloo work. Each pending work keeps the group's sockets open (it holds gloo's
        context), and a failed loop's traceback keeps its handles alive until the cyclic garbage
        collector runs: a peer blocked on us would wait out its whole timeout."""
        self._work = None

    def wait(self, timeout_s: float) -> None:
        if self._done:  # gloo counts completions per buffer: a second wait would wait for another
            return
        work = self._work
        if work is None:
            raise TransferError(f"{self._what} failed: the group was closed", self._peer)
        outcome: list[BaseException | None] = []

        def gloo_wait() -> None:
            try:
                work.wait(datetime.timedelta(seconds=timeout_s))
                outcome.append(None)
            except RuntimeError as e:
                outcome.append(e)
            finally:
                self._woken.set()

        if not self._aborted.is_set():
            threading.Thread(target=gloo_wait, name="gloo-wait", daemon=True).start()
            self._woken.wait()
        if not outcome or self._aborted.is_set():  # `GlooTransport.abort` broke the group
            raise TransferError(f"{self._what} failed: the group was aborted", self._peer)
        e = outcome[0]
        if e is None:
            self._done = True
            return
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise TransferTimeout(
                f"{self._what} did not complete within {timeout_s:.0f} s", self._peer
            ) from e
        raise TransferError(f"{self._what} failed: {str(e).splitlines()[0][:200]}", self._peer) from e

    fence = wait


@contextlib.contextmanager
def _posting(what: str, peer: int) -> Iterator[None]:
    """gloo raises at once when the peer closed the group before the transfer was posted; that is
    the same failure as one that `wait` reports later, so it raises the same TransferError."""
    try:
        yield
    except RuntimeError as e:
        raise TransferError(f"{what} failed: {str(e).splitlines()[0][:200]}", peer) from e


def _require_host(buf: torch.Tensor, what: str) -> None:
    """gloo moves host memory only. Given a tensor elsewhere (the meta device, say, as a model's
    parameters are inside vLLM's layerwise reload) it resets the connection, and the peers see a
    broken transfer instead of the cause: refuse it here, by name."""
    if buf.device.type != "cpu":
        raise ValueError(f"gloo cannot {what} a tensor on the {buf.device} device (host memory only)")


def _bound_options(bind_host: str, timeout: datetime.timedelta) -> Any:
    """Options for a gloo group whose one device listens on `bind_host`. gloo's default device
    takes the address the hostname resolves to (127.0.0.1 on many machines), so peers on other
    hosts (or network namespaces) would be told to connect there. torch takes a device only
    through these options, which its binding names `_Options`/`_devices` (its type stub says
    `Options`/`devices`); tests/unit/test_gloo_bind.py pins the names."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # stub/binding name differ, see above
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    return options


class GlooTransport:
    """A standalone gloo process group (not torch's default group, which vLLM and the trainer
    already use), rendezvousing on a TCPStore hosted by group rank 0."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        group_id: str,
        timeout_s: float,
        bind_host: str | None = None,
    ):
        self.rank, self.world_size = rank, world_size
        self._store = store  # rank 0 hosts the store: keep it alive as long as the group
        prefixed = dist.PrefixStore(f"weightsync/{group_id}", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if bind_host is None:
            self._pg: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
                prefixed, rank, world_size, timeout
            )
        else:
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, _bound_options(bind_host, timeout))
        self._handles: weakref.WeakSet[_GlooHandle] = weakref.WeakSet()  # released by `close`
        self._handles_lock = threading.Lock()  # `close` comes from an abort, beside the loops
        self._aborted = threading.Event()

    @staticmethod
    def create_address(host: str, world_size: int, timeout_s: float) -> tuple[str, dist.Store]:
        """Rank 0: host a rendezvous store on a free port; returns ("host:port", store)."""
        store = dist.TCPStore(
            host,
            0,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        return f"{host}:{store.port}", store

    @classmethod
    def connect(
        cls,
        address: str,
        rank: int,
        world_size: int,
        group_id: str,
        timeout_s: float,
        store: dist.Store | None = None,
        bind_host: str | None = None,
    ) -> GlooTransport:
        """Join the group; blocks until every member joined or `timeout_s` passed. `bind_host`:
        the address this member's gloo sockets listen on and advertise to its peers (the one it
        reported); None leaves it to gloo, which takes what this machine's hostname resolves to."""
        if store is None:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"gloo group address must be host:port, got {address!r}")
            store = dist.TCPStore(
                host, int(port), world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
            )
        return cls(store, rank, world_size, group_id, timeout_s, bind_host)

    def _group(self) -> dist.ProcessGroupGloo:
        if self._pg is None:
            raise RuntimeError(f"gloo transport of rank {self.rank} is closed")
        return self._pg

    def isend(self, buf: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        """`tag`: messages of one peer match in posting order per tag (the shared-memory
        transport sends its small notices on tags of their own)."""
        _require_host(buf, "send from")
        what = f"send of {buf.numel()} bytes to rank {peer}"
        with _posting(what, peer):
            work = self._group().send([buf], peer, tag)  # type: ignore[attr-defined]  # torch's stub lacks Backend.send
        return self._track(_GlooHandle(work, what, peer, self._aborted))

    def irecv(self, buf: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        _require_host(buf, "receive into")
        what = f"receive of {buf.numel()} bytes from rank {peer}"
        with _posting(what, peer):
            work = self._group().recv([buf], peer, tag)  # type: ignore[attr-defined]  # torch's stub lacks Backend.recv
        return self._track(_GlooHandle(work, what, peer, self._aborted))

    def _track(self, handle: _GlooHandle) -> _GlooHandle:
        with self._handles_lock:
            if self._pg is None:  # closed while this one was posted
                handle.release()
            else:
                self._handles.add(handle)
        return handle

    def abort(self) -> None:
        """Break the group now: every send and receive pending on it, ours and our peers', fails
        at once (a peer cut off from us fails at its own abort or timeout).

        Neither gloo's abort nor dropping the group ends a wait that already blocks: it waits out
        its whole timeout (measured, torch 2.13), and a refit's abort would leave its transfers
        hanging for as long. A receive that times out, though, makes gloo close every pair of the
        group, which wakes every wait on it and closes the sockets. So the abort posts a receive
        nobody will match and gives it a millisecond."""
        pg = self._pg
        if pg is None:  # closed: nothing left to unblock
            return
        self._aborted.set()
        with self._handles_lock:
            pending = list(self._handles)
        for handle in pending:
            handle.interrupt()
        with contextlib.suppress(RuntimeError):  # already aborted or torn down
            pg.abort()
        for peer in (r for r in range(self.world_size) if r != self.rank):
            try:
                pg.recv([torch.empty(1, dtype=torch.uint8)], peer, _BREAK_TAG).wait(_BREAK_WAIT)  # type: ignore[attr-defined]  # torch's stub lacks Backend.recv
            except RuntimeError as e:
                if "timed out" in str(e).lower():
                    return  # gloo closed every pair
                # this peer's pair is gone already: break the others through the next one

    def close(self) -> None:
        """Abort and drop the group so its sockets close: peers fail fast instead of timing out.
        gloo's abort does not unblock a peer's pending send (measured, torch 2.13): only closed
        sockets do, and they close when the group and every work posted on it are gone."""
        self.abort()
        with self._handles_lock:
            for handle in list(self._handles):
                handle.release()
            self._handles.clear()
            self._pg = None
