"""The same-host message channel of the colocated data planes (`local_channel.SocketChannel`):
messages by key in any order, large values whole, a clear error (never a hang) when the peer is
silent or gone, two processes meeting through a store, and members on one GPU meeting by their
group's address (`ipc_links.meet`)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch.distributed as dist

from syncd.member.dataplane.ipc_links import create_address, meet
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


def test_members_on_one_gpu_meet_by_their_groups_address_in_any_order():
    """`ipc_links.meet`: every pair of three ranks connected, whichever rank starts first."""
    address = create_address()
    met: dict[int, dict[int, SocketChannel]] = {}

    def join(rank: int) -> None:
        met[rank] = meet(address, rank, [r for r in range(3) if r != rank], 10.0)

    threads = [threading.Thread(target=join, args=(r,)) for r in (2, 0, 1)]
    for t in threads:
        t.start()
        time.sleep(0.05)  # the connecting ranks come before the listening one
    for t in threads:
        t.join(timeout=15)
    assert sorted(met) == [0, 1, 2] and all(
        sorted(c) == [p for p in range(3) if p != r] for r, c in met.items()
    )
    for a, b in ((0, 1), (0, 2), (1, 2)):
        met[a][b].post("x", f"{a} to {b}".encode())
        assert met[b][a].take("x", 5.0) == f"{a} to {b}".encode()
    for channels in met.values():
        for channel in channels.values():
            channel.close()


def test_a_rank_that_never_comes_to_the_meeting_is_named():
    with pytest.raises(TransferTimeout, match="group rank 1 did not connect"):
        meet(create_address(), 0, [1], 0.3)
    with pytest.raises(TransferTimeout, match="group rank 0 did not listen"):
        meet(create_address(), 1, [0], 0.3)


def test_a_close_wakes_a_take_blocked_in_another_thread(pair):
    left, _ = pair
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            left.take("never", 30.0)
        except TransferError as e:
            failed.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    left.close()
    waiter.join(timeout=5)
    assert not waiter.is_alive() and failed
