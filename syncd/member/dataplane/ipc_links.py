"""The CUDA IPC links of one stage group, as the agent runs them: syncd chooses them for a group
whose members all share memory (one GPU, or GPUs that read each other's: `syncd.plan.transports`),
`cuda_ipc` moves their bytes.

Meeting. Such a group has no NCCL communicator (NCCL refuses two ranks on one GPU): rank 0
reports a random token as the group's address (`create_address`), which syncd relays to every
rank. At join, every pair meets on an abstract Unix socket named after the token and the pair's
ranks: the lower rank listens, the higher connects and says who it is. An abstract name lives
only while its socket is open, so nothing is left behind, a killed process's included.

A refit: a sender offers its units to each of its receivers (each starts copying while the sender
offers to the next), then waits for every "done"; a receiver takes its senders one after another.
Each side's checksums go into its report, as over NCCL, so syncd compares what the sender held
with what landed. A link CUDA IPC cannot carry (`syncd.plan.transports.ipc_refusal`) has no other
way in such a group: the agent fails the refit by name.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from syncd.member.dataplane.cuda_ipc import IpcReceiver, IpcSender
from syncd.member.dataplane.executor import TransferStats
from syncd.member.dataplane.local_channel import SocketChannel
from syncd.member.dataplane.transport import TransferError, TransferTimeout
from syncd.plan.types import Bucket

_RETRY_S = 0.01  # between attempts to reach a peer that is not listening yet
ADDRESS_PREFIX = "cuda-ipc:"  # the address of a group without an NCCL communicator


def create_address() -> str:
    """Group rank 0 of a CUDA IPC group: the token its pairs meet by."""
    return ADDRESS_PREFIX + secrets.token_hex(16)


def _socket_name(address: str, a: int, b: int) -> str:
    digest = hashlib.sha1(address.encode()).hexdigest()[:20]
    return f"\0weightsync-ipc-{digest}-{min(a, b)}-{max(a, b)}"


def _hello(address: str, rank: int) -> str:
    return f"hello/{hashlib.sha1(address.encode()).hexdigest()[:20]}/{rank}"


def _connect(name: str, deadline: float, peer: int, timeout_s: float) -> socket.socket:
    """Connect to the peer's listening socket, waiting for it to exist until `deadline`."""
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(name)
            return sock
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            if time.monotonic() >= deadline:
                raise TransferTimeout(
                    f"cuda ipc: group rank {peer} did not listen within {timeout_s:.0f} s", peer
                ) from None
            time.sleep(_RETRY_S)


def meet(address: str, rank: int, peers: Iterable[int], timeout_s: float) -> dict[int, SocketChannel]:
    """A connected channel to each of `peers` (group ranks). All listening sockets
    exist before this rank connects anywhere, so the pairs meet in any order."""
    deadline = time.monotonic() + timeout_s
    servers: dict[int, socket.socket] = {}
    channels: dict[int, SocketChannel] = {}
    try:
        for peer in sorted(p for p in peers if p > rank):
            server = servers[peer] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(_socket_name(address, rank, peer))
            server.listen(1)
        for peer in sorted(p for p in peers if p < rank):
            channel = channels[peer] = SocketChannel(
                _connect(_socket_name(address, rank, peer), deadline, peer, timeout_s)
            )
            channel.post("hello", _hello(address, rank).encode())
        for peer, server in servers.items():
            server.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                sock, _ = server.accept()
            except TimeoutError:
                raise TransferTimeout(
                    f"cuda ipc: group rank {peer} did not connect within {timeout_s:.0f} s", peer
                ) from None
            sock.settimeout(None)
            channel = channels[peer] = SocketChannel(sock)
            said = channel.take("hello", max(deadline - time.monotonic(), 0.001))
            if said != _hello(address, peer).encode():
                raise TransferError(f"cuda ipc: expected group rank {peer}, met {said[:80]!r}", peer)
    except BaseException:
        for channel in channels.values():
            channel.close()
        raise
    finally:
        for server in servers.values():
            server.close()
    return channels


@contextlib.contextmanager
def _naming(peer: int) -> Iterator[None]:
    """Transfer errors inside name the peer's group rank (the agent names the member)."""
    try:
        yield
    except TransferError as e:
        raise type(e)(str(e), peer) from e


class IpcLinks:
    """This member's CUDA IPC peers in one group (`peers`: group ranks) and what it keeps for them
    between refits: a sender's exports and prepared checksums, a receiver's mappings."""

    def __init__(self, channels: Mapping[int, SocketChannel], device: torch.device) -> None:
        self._channels = dict(channels)
        self._device = device
        self._senders: dict[int, IpcSender] = {}
        self._receivers: dict[int, IpcReceiver] = {}
        # Held while a refit's copies may read mapped memory: `close` (an abort's thread) unmaps
        # only after them, never under a running kernel.
        self._busy = threading.Lock()

    @property
    def peers(self) -> frozenset[int]:
        return frozenset(self._channels)

    def send(
        self,
        buckets: Sequence[Bucket],
        views: Mapping[str, torch.Tensor],
        ranks: Mapping[str, int],
        refit: str,
        timeout_s: float,
    ) -> TransferStats:
        """Every bucket (this member's CUDA IPC buckets) to its receiver; returns the
        checksums of what this member holds, once every receiver is done."""
        start = time.perf_counter()
        by_peer = self._by_peer(buckets, lambda b: ranks[b.dst])
        checksums: dict[str, str] = {}
        with self._busy, torch.cuda.device(self._device):
            offered = []
            for peer, units in by_peer.items():
                sender = self._senders.setdefault(peer, IpcSender(views))
                sender.views = views
                with _naming(peer):
                    offered.append((peer, sender, sender.offer(units, self._channels[peer], refit)))
            for peer, sender, sums in offered:
                checksums.update(sums.result())
                with _naming(peer):
                    sender.wait_done(self._channels[peer], refit, timeout_s)
        return self._stats(buckets, checksums, start)

    def receive(
        self,
        buckets: Sequence[Bucket],
        views: Mapping[str, torch.Tensor],
        ranks: Mapping[str, int],
        refit: str,
        timeout_s: float,
    ) -> TransferStats:
        """Every bucket (this member's CUDA IPC buckets) copied into `views`; returns
        the checksums of what landed."""
        start = time.perf_counter()
        checksums: dict[str, str] = {}
        with self._busy, torch.cuda.device(self._device):
            for peer, units in self._by_peer(buckets, lambda b: ranks[b.src]).items():
                receiver = self._receivers.setdefault(peer, IpcReceiver())
                with _naming(peer):
                    checksums.update(receiver.receive(units, views, self._channels[peer], refit, timeout_s))
        return self._stats(buckets, checksums, start)

    @staticmethod
    def _by_peer(buckets: Sequence[Bucket], peer_of) -> dict[int, list]:
        out: dict[int, list] = defaultdict(list)
        for b in buckets:
            out[peer_of(b)].extend(b.units)
        return out

    @staticmethod
    def _stats(buckets: Sequence[Bucket], checksums: dict[str, str], start: float) -> TransferStats:
        return TransferStats(
            sum(b.nbytes for b in buckets), len(buckets), checksums, time.perf_counter() - start
        )

    def close(self) -> None:
        """The group ends (abort, failure, regroup): channels closed, so a peer waiting on one
        fails at once, and every mapping of a sender's memory released."""
        for channel in self._channels.values():
            channel.close()  # wakes a refit waiting on the peer
        with self._busy, torch.cuda.device(self._device):
            for receiver in self._receivers.values():
                receiver.close()
            for sender in self._senders.values():
                sender.close()
        self._receivers.clear()
        self._senders.clear()
