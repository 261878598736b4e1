"""NCCL transport through nccl4py's `nccl.core` API (GPU members).

Streams: sends and receives run on the transport's own CUDA stream. A send first waits (on the GPU)
for the stream that packed its buffer; a receive first waits for the stream that unpacked the
buffer's previous contents, so a buffer is never read while in flight nor overwritten before use.
Completion is an event the host polls with a timeout, and the communicator is created
non-blocking, so neither a missing peer at init nor a lost one mid-transfer can hang a process:
the caller aborts the communicator instead.
"""

from __future__ import annotations

import base64
import functools
import threading
import time
from collections.abc import Callable, Sequence

import torch

from syncd.member.dataplane.transport import OneCaller, TransferError, TransferTimeout

_Op = tuple[Callable[..., None], torch.Tensor, int, str]  # nccl4py's send or recv, buffer, peer, what
_POLL_S = 50e-6
# How long a wait spins before it sleep-polls. `torch.cuda.Event.query` holds the GIL, so a
# spinning waiter keeps every other Python thread of the process out (a receiver runs one loop
# per trainer stage, each in its own thread): one that gives the GIL up for a launch gets it back
# only when the spinner is forced to switch, after `sys.getswitchinterval()` (5 ms). A spin of
# about half a 64 MiB bucket's time on NVLink (0.2 ms) keeps the wake-up quick for short waits and
# bounds what another thread can lose to it.
_SPIN_S = 100e-6
# How long `settle` spins before it sleep-polls. A non-blocking communicator hands every call's
# host-side work to a thread of NCCL's own (NCCL 2.28 starts one per call: its send or receive
# settles some 50 us later, measured on 2x H200); a sleep would add its wake-up latency to every
# bucket's post, which at 64 MiB buckets is as long as the transfer itself.
_SETTLE_SPIN_S = 5e-3


@functools.cache
def _nccl():
    """(nccl.core, nccl.bindings.nccl), imported on first use and kept (an import statement costs
    microseconds even when the module is loaded, and the waits call this in their poll loops): the
    GPU extra is optional."""
    try:
        import nccl.core as nccl_core
        from nccl.bindings import nccl as nccl_bindings
    except ImportError as e:  # say how to get it
        raise RuntimeError("the NCCL transport needs nccl4py: pip install 'weightsync[nccl]'") from e
    return nccl_core, nccl_bindings


class _EventHandle:
    def __init__(self, event: torch.cuda.Event, transport: NcclTransport, what: str):
        self._event, self._transport, self._what = event, transport, what

    def fence(self, timeout_s: float) -> None:
        torch.cuda.current_stream(self._transport.device).wait_event(self._event)

    def wait(self, timeout_s: float) -> None:
        # Spin first (a short wait ends sooner than a sleep would wake up), then sleep-poll,
        # which lets the process's other threads run (see `_SPIN_S`).
        start = time.monotonic()
        deadline = start + timeout_s
        while not self._event.query():
            now = time.monotonic()
            if now - start > _SPIN_S:
                self._transport.raise_async_error(self._what)
                if now > deadline:
                    raise TransferTimeout(f"{self._what} did not complete within {timeout_s:.0f} s")
                time.sleep(_POLL_S)
        if self._transport.aborted:  # an abort ends the kernels, and their events fire as if done
            raise TransferError(f"{self._what} failed: the communicator was aborted")


class NcclTransport:
    def __init__(self, comm, rank: int, world_size: int, device: torch.device, op_timeout_s: float = 300.0):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.op_timeout_s = op_timeout_s
        self._comm = comm
        # An abort comes from another thread (syncd's Abort) while the loops poll and enqueue:
        # no call may use the communicator while, or after, it is freed.
        self._comm_lock = threading.Lock()
        # Highest priority: the loops enqueue packs, unpacks and checksums ahead, and these become
        # ready the moment a transfer ends, just as the next transfer does. At equal priority the
        # GPU may hand its SMs to the copy kernels first and the link idles until they drain.
        self.stream = torch.cuda.Stream(device, priority=-100)
        # Buffers are passed to NCCL as (pointer, byte count, uint8), the dtype resolved once:
        # nccl4py's Communicator.send and recv resolve the buffer through DLPack and check its
        # device on every call, tens of microseconds of host time per bucket (py-spy, 2x H200,
        # 64 MiB buckets), and the executor only ever moves bytes.
        self._uint8: int | None = None
        self._one_caller = OneCaller(f"NCCL communicator of rank {rank}/{world_size}")

    @staticmethod
    def create_address() -> str:
        """Group rank 0: a fresh NCCL unique id, as text syncd can relay."""
        nccl_core, _ = _nccl()
        return base64.b64encode(nccl_core.get_unique_id().as_bytes).decode()

    @classmethod
    def connect(
        cls, address: str, rank: int, world_size: int, device: torch.device, timeout_s: float
    ) -> NcclTransport:
        """Create this rank's communicator; raises TransferTimeout if the group does not form."""
        nccl_core, bindings = _nccl()
        uid = nccl_core.UniqueId.from_bytes(base64.b64decode(address))
        with torch.cuda.device(device):
            comm = nccl_core.Communicator()
            try:
                comm.initialize(world_size, rank, uid, nccl_core.NCCLConfig(blocking=False))
            except bindings.NCCLError as e:
                raise TransferError(f"NCCL init of rank {rank}/{world_size} failed: {e}") from e
            transport = cls(comm, rank, world_size, device, timeout_s)
            transport.settle(f"NCCL group of {world_size} (rank {rank})", timeout_s)
        return transport

    def settle(self, what: str, timeout_s: float) -> None:
        """Wait until the last call on this non-blocking communicator completed its host-side
        part (init, or a first send/recv that sets up connections); NCCL refuses any further call
        before that. Aborts and raises on timeout or error."""
        start = time.monotonic()
        while (state := self._state()) == "in_progress":
            now = time.monotonic()
            if now - start > timeout_s:
                self.abort()
                raise TransferTimeout(f"{what} did not complete within {timeout_s:.0f} s")
            if now - start > _SETTLE_SPIN_S:
                time.sleep(_POLL_S)
        if state != "ok":
            self.abort()
            raise TransferError(f"{what} failed: NCCL {state}")

    def _state(self) -> str:
        _, bindings = _nccl()
        with self._comm_lock:
            if self._comm is None:
                return "error: communicator aborted"
            result = bindings.comm_get_async_error(self._comm._comm)  # the binding, as `_enqueue` polls
        if result == bindings.Result.InProgress:
            return "in_progress"
        return "ok" if result == bindings.Result.Success else f"error {result!r}"

    @property
    def aborted(self) -> bool:
        return self._comm is None

    def raise_async_error(self, what: str) -> None:
        state = self._state()
        if state.startswith("error"):
            raise TransferError(f"{what} failed: NCCL {state}")

    def _buffer(self, buf: torch.Tensor) -> tuple[int, int, int]:
        """(pointer, count, NCCL dtype) of `buf`'s bytes."""
        if buf.device != self.device or not buf.is_contiguous():
            raise ValueError(f"NCCL buffers must be contiguous on {self.device}, got {buf.device}")
        flat = buf if buf.dtype == torch.uint8 and buf.dim() == 1 else buf.reshape(-1).view(torch.uint8)
        if self._uint8 is None:
            from nccl.core.buffer import NcclBuffer

            self._uint8 = int(NcclBuffer(flat).dtype)
        return flat.data_ptr(), flat.numel(), self._uint8

    def _enqueue(self, ops: Sequence[_Op]) -> list[_EventHandle]:
        """`ops`: (nccl4py's raw binding, send or recv; buffer; peer; what), posted as one NCCL
        group when there are several, so that they progress together instead of one after the
        other on the transport's stream."""
        _, bindings = _nccl()
        what = "; ".join(w for _, _, _, w in ops)
        with self._one_caller():
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            args = [(op, *self._buffer(buf), int(peer)) for op, buf, peer, _ in ops]
            with self._comm_lock:  # an abort from another thread frees the communicator
                if self._comm is None:
                    raise TransferError(f"{what} failed: the communicator was aborted")
                try:
                    if len(args) > 1:
                        bindings.group_start()
                    try:
                        for op, ptr, count, dtype, peer in args:
                            op(ptr, count, dtype, peer, self._comm._comm, self.stream.cuda_stream)
                    finally:
                        if len(args) > 1:
                            bindings.group_end()
                except bindings.NCCLError as e:
                    raise TransferError(f"{what} failed: {e}") from e
                # One state query settles the common case (the enqueue completed in the call); only
                # a call still in progress (connection setup on the first transfers) is polled.
                settled = bindings.comm_get_async_error(self._comm._comm) == bindings.Result.Success
            if not settled:
                self.settle(what, self.op_timeout_s)
            done = torch.cuda.Event()
            done.record(self.stream)
        # No wait back on the caller's stream: the executor fences on `done` only where it reuses
        # or reads `buf`, so packing the next bucket overlaps this transfer. A group's operations
        # share the event: they end together.
        return [_EventHandle(done, self, w) for _, _, _, w in ops]

    def isend(self, buf: torch.Tensor, peer: int) -> _EventHandle:
        return self._enqueue([(_nccl()[1].send, buf, peer, _sending(buf, peer))])[0]

    def isend_group(self, sends: Sequence[tuple[torch.Tensor, int]]) -> list[_EventHandle]:
        """Sends to several peers (buffer, peer) in one NCCL group: each link moves at once."""
        send = _nccl()[1].send
        return self._enqueue([(send, buf, peer, _sending(buf, peer)) for buf, peer in sends])

    def irecv(self, buf: torch.Tensor, peer: int) -> _EventHandle:
        what = f"receive of {buf.numel()} bytes from rank {peer}"
        return self._enqueue([(_nccl()[1].recv, buf, peer, what)])[0]

    def abort(self) -> None:
        """End every send and receive in flight: the kernels stop, and the waits polling them
        (`_EventHandle.wait`, `settle`) see the communicator gone and raise TransferError."""
        with self._comm_lock:
            comm, self._comm = self._comm, None
            if comm is not None:
                comm.abort()

    def close(self) -> None:
        self.abort()


def _sending(buf: torch.Tensor, peer: int) -> str:
    return f"send of {buf.numel()} bytes to rank {peer}"
