"""Small messages between two processes of one host, by key: what the colocated data planes
(`cuda_ipc`) say to each other during a refit ("here are my tensors", "done").

`SocketChannel` sends each message as one frame on a Unix stream socket: tens of microseconds.
A TCPStore round trip took about 0.7 ms to post the 5 KB offer of a 39-tensor model on an H100
machine, a tenth of the whole 4 GB refit (`bench/colocated_bench.py --device cuda`, 2026-11-26).
`StoreChannel` (over a torch `dist.Store`) stays for rendezvous-only uses.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Protocol

from syncd.member.dataplane.transport import TransferError, TransferTimeout

_HEADER = struct.Struct("!II")  # key bytes, value bytes
# A post blocks only while the peer's socket buffer is full (messages are a few KB): a peer that
# reads nothing for this long is stuck.
POST_TIMEOUT_S = 60.0


class Channel(Protocol):
    """Small messages between the two members of a link, by key (a refit's keys are unique)."""

    def post(self, key: str, value: bytes) -> None: ...
    def take(self, key: str, timeout_s: float) -> bytes: ...


class SocketChannel:
    """A `Channel` over a connected stream socket. A `take` returns its key's value and keeps any
    other message that arrived before it for a later `take`."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._early: dict[str, bytes] = {}
        self._buffer = bytearray()

    def post(self, key: str, value: bytes) -> None:
        raw = key.encode()
        self._sock.settimeout(POST_TIMEOUT_S)
        try:
            self._sock.sendall(_HEADER.pack(len(raw), len(value)) + raw + value)
        except TimeoutError as e:
            raise TransferTimeout(f"local channel: the peer read nothing for {POST_TIMEOUT_S:.0f} s") from e
        except OSError as e:
            raise TransferError(f"local channel: cannot post {key!r}: {e}") from e

    def take(self, key: str, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        while key not in self._early:
            name, value = self._frame(key, deadline, timeout_s)
            self._early[name] = value
        return self._early.pop(key)

    def _frame(self, key: str, deadline: float, timeout_s: float) -> tuple[str, bytes]:
        header = self._read(_HEADER.size, key, deadline, timeout_s)
        key_len, value_len = _HEADER.unpack(header)
        body = self._read(key_len + value_len, key, deadline, timeout_s)
        return body[:key_len].decode(), body[key_len:]

    def _read(self, n: int, key: str, deadline: float, timeout_s: float) -> bytes:
        while len(self._buffer) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(f"local channel: no {key!r} from the peer within {timeout_s:.0f} s")
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(max(n - len(self._buffer), 1 << 16))
            except TimeoutError:
                continue  # the deadline check above says so
            except OSError as e:
                raise TransferError(f"local channel: waiting for {key!r}: {e}") from e
            if not chunk:
                raise TransferError(f"local channel: the peer closed the channel before {key!r}")
            self._buffer += chunk
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    def close(self) -> None:
        """Ends the channel; a `take` blocked in another thread fails at once (a shutdown wakes
        it, a close alone does not)."""
        with contextlib.suppress(OSError):  # never connected, or the peer is gone
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def socket_channel(store: Any, name: str, listen: bool, timeout_s: float) -> SocketChannel:
    """Two processes of one host meet on an abstract Unix socket (no file left behind) whose
    name the listening side publishes in `store` under `name`; returns the connected channel."""
    if listen:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address = f"\0weightsync-{name}-{id(server):x}-{time.monotonic_ns():x}"
        server.bind(address)
        server.listen(1)
        server.settimeout(timeout_s)
        store.set(name, address.encode())
        try:
            sock, _ = server.accept()
        except TimeoutError as e:
            raise TransferTimeout(f"local channel {name!r}: no peer within {timeout_s:.0f} s") from e
        finally:
            server.close()
    else:
        store.wait([name], datetime.timedelta(seconds=timeout_s))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(store.get(name).decode())
    sock.settimeout(None)
    return SocketChannel(sock)


@dataclass(frozen=True)
class StoreChannel:
    """A `Channel` over a torch `dist.Store`: one round trip a message each way. Taken keys are
    not deleted (a delete is one more round trip on the refit's path): for one run's messages."""

    store: Any
    prefix: str

    def post(self, key: str, value: bytes) -> None:
        self.store.set(f"{self.prefix}/{key}", value)

    def take(self, key: str, timeout_s: float) -> bytes:
        self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        try:
            return self.store.get(f"{self.prefix}/{key}")  # waits for the key
        except Exception as e:  # the store raises its own error types on a timeout or a lost peer
            raise TransferTimeout(
                f"local channel: no {key!r} from the peer within {timeout_s:.0f} s ({e})"
            ) from e
