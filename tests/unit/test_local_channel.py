"""The same-host message channel of the colocated data planes (`local_channel.SocketChannel`):
messages by key in any order, large values whole, a clear error (never a hang) when the peer is
silent or gone, and two processes meeting through a store."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from syncd.member.dataplane.local_channel import SocketChannel, socket_channel
from syncd.member.dataplane.transport import TransferError, TransferTimeout
from syncd.net import free_port


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    left, right = SocketChannel(a), SocketChannel(b)
    yield left, right
    left.close()
    right.close()


def test_takes_by_key_whatever_the_order_of_posts(pair):
    left, right = pair
    big = bytes(range(256)) * 160  # 40 KB, within what the socket buffers unread
    left.post("r1/ready", b"offer")
    left.post("r1/sums", big)
    left.post("empty", b"")
    assert right.take("r1/sums", 5) == big
    assert right.take("empty", 5) == b""
    assert right.take("r1/ready", 5) == b"offer"


def test_a_silent_peer_times_out_and_a_closed_one_fails_at_once(pair):
    left, right = pair
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout, match="'r1/done'"):
        right.take("r1/done", 0.3)
    assert time.monotonic() - t0 < 5
    left.post("half", b"x")
    left.close()
    assert right.take("half", 5) == b"x"  # what came before the close still arrives
    with pytest.raises(TransferError, match="closed the channel before 'r2/done'"):
        right.take("r2/done", 5)
    with pytest.raises(TransferError, match="cannot post 'late'"):
        right.post("late", b"y")


def test_two_processes_meet_through_a_store():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    peer = textwrap.dedent(f"""
        import datetime, torch.distributed as dist
        from syncd.member.dataplane.local_channel import socket_channel
        store = dist.TCPStore("127.0.0.1", {port}, is_master=False, timeout=datetime.timedelta(seconds=30))
        channel = socket_channel(store, "meet", listen=False, timeout_s=30)
        channel.post("ping", channel.take("hello", 30) + b"!")
    """)
    proc = subprocess.Popen([sys.executable, "-c", peer])
    try:
        channel = socket_channel(store, "meet", listen=True, timeout_s=30)
        channel.post("hello", b"hi")
        assert channel.take("ping", 30) == b"hi!"
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
