"""Same-host data plane: POSIX shared memory between the processes of one host, under the
executor's `Transport` protocol, so `send_buckets`/`recv_buckets` run unchanged.

`ShmTransport` wraps the stage group's gloo transport. To a peer on another host it passes every
call through (one plan mixes both); to a peer on this host (`local_peers`, chosen by syncd from
the hosts members reported, `syncd.plan.transports`) the bytes go through shared memory and gloo
carries only two small notices per bucket, on tags of their own:

- the sender's bucket lies in one of its segments (the loops' staging, which the agent's
  `LoopCache` allocates here) or is copied into one (a tensor sent as it is): it sends
  "bucket in segment n at offset, nbytes" (tag 1);
- the receiver maps the segment (once), copies the bytes out into its buffer (the one copy the
  wire costs) and answers "done" (tag 2). The send's handle completes on that answer, so the
  loops reuse a staging slot only after the receiver copied it out, as they do over gloo;
- or, with no copy at all (`irecv_shared`), the receive loop unpacks straight from the mapped
  segment and the receiver answers "done" once it did (`SharedRecv.release`).

Lifetimes. Segments belong to the sender: files under /dev/shm named
`weightsync-<pid>-<group token>-<n>`, whose names exist only while a refit runs. `end_refit` (the
agent calls it when its transfer ended: done, failed or aborted) unlinks them; the memory stays
mapped in the sender and in the receivers that mapped it, so the next refit of the same group
reuses it without faulting in fresh pages (as the loops keep their staging over gloo), and a
segment a refit did not use is unmapped then. `close` (the group is dropped: abort, regroup)
unmaps everything, and the kernel frees the memory once no process maps it, a killed one
included. A process killed mid-refit leaves its names behind: `sweep_orphans` unlinks those whose
pid is no longer alive (the agent sweeps at every join, abort and end of refit).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import queue
import threading
from collections.abc import Iterable
from pathlib import Path

import torch

from syncd.member.dataplane.transport import GlooTransport, Handle, TransferError, TransferTimeout

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "weightsync-"
_READY, _DONE = 1, 2  # gloo tags of the notices
_NOTICE = 5  # int64 fields of a "bucket ready" notice: pid, segment, offset, nbytes, segment size
_BOUNCE_SLOTS = 2  # per peer: segments a tensor sent as it is gets copied into
_COPY_WAIT_S = 3600.0  # the copy thread's bound on one notice (see `_RecvHandle.copy_out`)
_PENDING_ANSWERS = 16  # "done" notices in flight before the oldest is waited for


def _token(group_id: str, rank: int) -> str:
    return hashlib.sha1(f"{group_id}/{rank}".encode()).hexdigest()[:10]


def _segment_path(pid: int, token: str, number: int) -> Path:
    return SHM_DIR / f"{SHM_PREFIX}{pid}-{token}-{number}"


def _map(path: Path, nbytes: int, create: bool) -> torch.Tensor:
    """A byte tensor over the file's shared mapping; the mapping lives as long as the tensor."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        mapped = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_orphans(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the segments of processes that are gone (killed mid-refit); returns their names.
    Pids are those of this pid namespace: members of one host that share /dev/shm across
    containers must share the pid namespace too, or sweep only what they know is theirs."""
    removed = []
    for path in shm_dir.glob(f"{SHM_PREFIX}*"):
        pid = path.name[len(SHM_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):  # a peer swept it first
                path.unlink()
                removed.append(path.name)
    return removed


class _Segment:
    def __init__(self, number: int, path: Path, nbytes: int) -> None:
        self.number, self.path = number, path
        nbytes = max(nbytes, 1)  # an empty bucket (a delta with nothing changed) still gets one
        self.tensor = _map(path, nbytes, create=True)
        self.start = self.tensor.data_ptr()
        self.end = self.start + nbytes
        self.linked = True  # its name is in /dev/shm: a peer can map it
        self.mapped_by: set[int] = set()  # peers that mapped it (they answered a bucket in it)
        self.used_by: set[int] = set()  # peers sent to from it during the current refit

    def offset_of(self, buf: torch.Tensor) -> int | None:
        """Where `buf` lies in this segment (contiguous bytes), or None."""
        ptr = buf.data_ptr()
        if self.start <= ptr and ptr + buf.numel() * buf.element_size() <= self.end and buf.is_contiguous():
            return ptr - self.start
        return None

    def reachable_by(self, peer: int) -> bool:
        return self.linked or peer in self.mapped_by

    def unlink(self) -> None:
        self.linked = False
        with contextlib.suppress(FileNotFoundError):  # a sweep or an earlier end took it
            self.path.unlink()


class _SendHandle:
    """Done when the receiver copied the bucket out (its "done" notice arrived)."""

    def __init__(self, gloo: GlooTransport, segment: _Segment, notice: torch.Tensor, peer: int) -> None:
        # Both small tensors stay referenced here until their transfers completed.
        self._notice, self._answer = notice, torch.empty(1, dtype=torch.int64)
        self._segment, self._peer = segment, peer
        self._posted = gloo.isend(notice, peer, _READY)
        self._done = gloo.irecv(self._answer, peer, _DONE)

    def wait(self, timeout_s: float) -> None:
        self._posted.wait(timeout_s)
        self._done.wait(timeout_s)
        self._segment.mapped_by.add(self._peer)

    fence = wait


class _RecvHandle:
    """A receive from a local peer: the transport's copy thread waits for the sender's notice and
    copies the bucket out of its segment into `buf`, in posting order, as gloo's own thread
    receives; so the loop unpacks bucket i while bucket i + 1 is copied out."""

    def __init__(self, transport: ShmTransport, buf: torch.Tensor, peer: int) -> None:
        self._transport, self._buf, self._peer = transport, buf, peer
        self._notice = torch.zeros(_NOTICE, dtype=torch.int64)
        self._ready = transport.gloo.irecv(self._notice, peer, _READY)
        self._copied = threading.Event()
        self._error: BaseException | None = None

    def copy_out(self) -> None:
        """On the copy thread. Its wait is only a bound: the loop's own timeout ends the refit
        first, and closing the group unblocks it."""
        try:
            self._ready.wait(_COPY_WAIT_S)
            pid, number, offset, nbytes, size = (int(x) for x in self._notice.tolist())
            if nbytes != self._buf.numel():
                raise TransferError(
                    f"rank {self._peer} sent {nbytes} bytes into a receive of {self._buf.numel()}", self._peer
                )
            segment = self._transport.peer_segment(self._peer, pid, number, size)
            self._buf.copy_(segment[offset : offset + nbytes])
            self._transport.acknowledge(self._peer)
        except BaseException as e:  # noqa: BLE001 - handed to the loop, which raises it in wait
            self._error = e
        finally:
            self._copied.set()

    def wait(self, timeout_s: float) -> None:
        if not self._copied.wait(timeout_s):
            raise TransferTimeout(
                f"receive of {self._buf.numel()} bytes from rank {self._peer} did not complete "
                f"within {timeout_s:.0f} s",
                self._peer,
            )
        if self._error is not None:
            raise self._error

    fence = wait


class SharedRecv:
    """A receive from a local peer read where the sender packed it: `wait` (or `fence`) waits for
    the sender's notice and maps its segment; `view` is then the bucket's bytes there, valid
    until `release`, which lets the sender reuse them."""

    def __init__(self, transport: ShmTransport, nbytes: int, peer: int) -> None:
        self._transport, self._nbytes, self._peer = transport, nbytes, peer
        self._notice = torch.zeros(_NOTICE, dtype=torch.int64)
        self._ready = transport.gloo.irecv(self._notice, peer, _READY)
        self._view: torch.Tensor | None = None
        self._released = False

    def wait(self, timeout_s: float) -> None:
        if self._view is not None:
            return
        self._ready.wait(timeout_s)
        pid, number, offset, nbytes, size = (int(x) for x in self._notice.tolist())
        if nbytes != self._nbytes:
            raise TransferError(
                f"rank {self._peer} sent {nbytes} bytes into a receive of {self._nbytes}", self._peer
            )
        segment = self._transport.peer_segment(self._peer, pid, number, size)
        self._view = segment[offset : offset + nbytes]
        self._transport.read_in_place_bytes += nbytes

    fence = wait

    @property
    def view(self) -> torch.Tensor:
        assert self._view is not None and not self._released, (
            "a shared receive is read between wait and release"
        )
        return self._view

    def release(self) -> None:
        """The bucket was read: the sender may write its segment again."""
        if not self._released:
            self._released = True
            self._transport.acknowledge(self._peer)


class ShmTransport:
    """Shared memory to `local_peers` (group ranks on this host), gloo to everyone else."""

    def __init__(self, gloo: GlooTransport, local_peers: Iterable[int], group_id: str, timeout_s: float):
        self.gloo, self.local_peers = gloo, frozenset(local_peers)
        self.rank, self.world_size = gloo.rank, gloo.world_size
        self._group_id, self._timeout_s = group_id, timeout_s
        self._token = _token(group_id, gloo.rank)
        self._numbers = 0
        self._own: list[_Segment] = []  # staging handed to the loops, and bounce segments
        self._bounce: dict[int, list[tuple[_Segment, _SendHandle | None]]] = {}
        self._mapped: dict[tuple[int, int], torch.Tensor] = {}  # (peer, segment) -> its mapping
        self._mapped_used: set[tuple[int, int]] = set()  # ... of those, read during this refit
        self._acks: list[Handle] = []
        self._one = torch.ones(1, dtype=torch.int64)
        self.shared_bytes = 0  # sent through shared memory, over the transport's life
        self.read_in_place_bytes = 0  # ... of those received, read in the sender's segment
        self._copies: queue.SimpleQueue[_RecvHandle | None] = queue.SimpleQueue()
        self._copier: threading.Thread | None = None

    # ---- the loops' staging ----

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A staging buffer in a segment of this member: sends from it move no extra copy."""
        return self._new_segment(nbytes).tensor

    def _new_segment(self, nbytes: int) -> _Segment:
        self._numbers += 1
        segment = _Segment(self._numbers, _segment_path(os.getpid(), self._token, self._numbers), nbytes)
        self._own.append(segment)
        return segment

    # ---- Transport ----

    def isend(self, buf: torch.Tensor, peer: int) -> Handle:
        if peer not in self.local_peers:
            return self.gloo.isend(buf, peer)
        nbytes = buf.numel() * buf.element_size()
        self.shared_bytes += nbytes
        segment, offset = self._locate(buf)
        if segment is None or not segment.reachable_by(peer):
            segment, offset = self._bounce_into(buf, peer, nbytes), 0
        segment.used_by.add(peer)
        notice = torch.tensor(
            [os.getpid(), segment.number, offset, nbytes, segment.end - segment.start], dtype=torch.int64
        )
        handle = _SendHandle(self.gloo, segment, notice, peer)
        ring = self._bounce.get(peer)
        if ring and ring[-1][0] is segment:  # a bounce segment: reused once this send is done
            ring[-1] = (segment, handle)
        return handle

    def irecv(self, buf: torch.Tensor, peer: int) -> Handle:
        if peer not in self.local_peers:
            return self.gloo.irecv(buf, peer)
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError(
                f"shared memory receives into contiguous host memory, not {buf.device} / strided"
            )
        handle = _RecvHandle(self, buf.view(torch.uint8).reshape(-1), peer)
        if self._copier is None:
            self._copier = threading.Thread(target=self._copy_loop, name="weightsync-shm-copy", daemon=True)
            self._copier.start()
        self._copies.put(handle)
        return handle

    def irecv_shared(self, nbytes: int, peer: int) -> SharedRecv:
        """A receive of `nbytes` from local `peer` that the caller reads in the sender's segment
        (no copy), then releases."""
        if peer not in self.local_peers:
            raise ValueError(f"rank {peer} is not on this host: no shared receive from it")
        return SharedRecv(self, nbytes, peer)

    def _copy_loop(self) -> None:
        while (handle := self._copies.get()) is not None:
            handle.copy_out()

    def abort(self) -> None:
        self.gloo.abort()

    def close(self) -> None:
        """Drop the group: unlink every name and unmap every segment, own and peers'."""
        self.gloo.close()  # fails a copy still waiting for its notice
        self._copies.put(None)
        for segment in self._own:
            segment.unlink()
        self._own, self._bounce, self._mapped, self._mapped_used = [], {}, {}, set()

    def end_refit(self) -> None:
        """The refit's transfer ended (done, failed or aborted): unlink this member's segment
        names, and unmap the segments, own and peers', that this refit did not use."""
        for segment in self._own:
            segment.unlink()
        self._own = [s for s in self._own if s.used_by]
        self._bounce = {p: [(s, h) for s, h in ring if s.used_by] for p, ring in self._bounce.items()}
        for segment in self._own:  # a peer keeps the mappings it read this refit, and only those
            segment.mapped_by &= segment.used_by
            segment.used_by = set()
        self._mapped = {k: v for k, v in self._mapped.items() if k in self._mapped_used}
        self._mapped_used = set()

    @property
    def segment_names(self) -> list[str]:
        """The names this member's segments have in /dev/shm now."""
        return [s.path.name for s in self._own if s.linked]

    # ---- used by the handles ----

    def _locate(self, buf: torch.Tensor) -> tuple[_Segment | None, int]:
        for segment in self._own:
            offset = segment.offset_of(buf)
            if offset is not None:
                return segment, offset
        return None, 0

    def _bounce_into(self, buf: torch.Tensor, peer: int, nbytes: int) -> _Segment:
        """A tensor sent as it is (not from staging) is copied into one of the peer's bounce
        segments, once the receiver copied out what that segment last held."""
        ring = self._bounce.setdefault(peer, [])
        if len(ring) < _BOUNCE_SLOTS:
            ring.append((self._new_segment(nbytes), None))
        segment, last = ring.pop(0)
        if last is not None:
            last.wait(self._timeout_s)
        if segment.end - segment.start < nbytes:  # too small for this bucket: a larger one
            self._own.remove(segment)
            segment.unlink()
            segment = self._new_segment(nbytes)
        ring.append((segment, None))
        segment.tensor[:nbytes].copy_(buf.reshape(-1).view(torch.uint8))
        return segment

    def peer_segment(self, peer: int, pid: int, number: int, size: int) -> torch.Tensor:
        key = (peer, number)
        self._mapped_used.add(key)
        mapped = self._mapped.get(key)
        if mapped is None:
            path = _segment_path(pid, _token(self._group_id, peer), number)
            try:
                mapped = self._mapped[key] = _map(path, size, create=False)
            except FileNotFoundError as e:
                raise TransferError(f"rank {peer}'s segment {path} is gone (its refit ended?)", peer) from e
        return mapped

    def acknowledge(self, peer: int) -> None:
        """Tell `peer` its bucket was copied out. The answers are tiny and leave at once; the
        oldest is waited for only to keep the list short."""
        if len(self._acks) >= _PENDING_ANSWERS:
            self._acks.pop(0).wait(self._timeout_s)
        self._acks.append(self.gloo.isend(self._one, peer, _DONE))
