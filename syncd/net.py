"""Network helpers shared by the launchers (`deploy/`), the benchmarks (`bench/`) and the tests, so
that none of them imports another for them."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (the OS picks it). The caller binds it
    soon after, as another process may pick the same port meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
