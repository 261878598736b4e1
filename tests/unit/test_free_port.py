"""`syncd.net.free_port`: a port a server can bind, outside the kernel's ephemeral range, where
outgoing connections could take it first."""

from __future__ import annotations

import socket

from syncd.net import _ephemeral_range, free_port


def test_a_free_port_is_bindable_and_no_ephemeral_port() -> None:
    low, high = _ephemeral_range()
    for _ in range(50):
        port = free_port()
        assert not low <= port <= high, (port, low, high)
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))
            server.listen()
