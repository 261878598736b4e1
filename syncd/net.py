"""Network helpers shared by the services, the launchers (`deploy/`), the benchmarks (`bench/`) and
the tests, so that none of them imports another for them."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

# How long our HTTP servers (syncd's API, the generator's OpenAI and control servers) keep an idle
# connection open for its next request. It must outlast the time clients keep one in their pools
# (httpx and openai 5 s, aiohttp 15 s): otherwise a client may send a request on a connection just
# as the server closes it, and the request fails with "Server disconnected without sending a
# response" although the server is healthy. uvicorn's default, 5 s, is exactly httpx's (CI once saw
# a demo client lose one of 1622 requests with that error). 75 s as nginx: an idle connection costs a
# socket, nothing more.
HTTP_KEEP_ALIVE_S = 75


# The kernel's ephemeral ports (net.ipv4.ip_local_port_range): where it picks the local port of
# every outgoing connection, and of a bind to port 0.
EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIRST_UNPRIVILEGED_PORT = 1024


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now, for a server the caller starts soon
    after. Outside the kernel's ephemeral range: a port the OS picked there (a bind to 0) was free,
    but any outgoing connection could take it before the server bound it, which on a busy test
    machine happened several times a run ("Address already in use"). Another caller of this
    function may still pick the same port meanwhile, at odds of one in tens of thousands."""
    low, high = _ephemeral_range()
    outside = [(FIRST_UNPRIVILEGED_PORT, low - 1), (high + 1, 65535)]
    ranges = [(a, b) for a, b in outside if a <= b]
    for _ in range(100 if ranges else 0):
        first, last = random.choice(ranges)
        port = random.randint(first, last)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use (or in TIME_WAIT): another one
                continue
            return port
    with socket.socket() as s:  # the range covers every port: let the OS pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(n) for n in EPHEMERAL_PORTS.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def host_identity() -> str:
    """What tells members on one host (and one network namespace) from the others: the kernel's
    boot id and this process's network namespace. Two members with the same identity can map each
    other's shared memory; the lab's network namespaces, which stand for hosts, differ. Falls
    back to the hostname where /proc does not tell."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return socket.gethostname()
    return f"{boot}/net:{netns}"


def gpu_identity(device: str) -> str:
    """The UUID of the GPU `device` ("cuda:N", numbered as this process sees them) names, the same
    in every process whatever its CUDA_VISIBLE_DEVICES; "" for a device that is not a GPU. Two
    members of one host with the same one can map each other's GPU memory (CUDA IPC)."""
    if not device.startswith("cuda"):
        return ""
    import torch  # only members on GPUs pay for it

    return _uuid(torch, _index(torch, device))


def peer_gpu_identities(device: str) -> tuple[str, ...]:
    """The UUIDs of the other GPUs this process sees that the GPU `device` names reads directly
    (peer access); () for a device that is not a GPU."""
    if not device.startswith("cuda"):
        return ()
    import torch

    mine = _index(torch, device)
    return tuple(
        _uuid(torch, i)
        for i in range(torch.cuda.device_count())
        if i != mine and torch.cuda.can_device_access_peer(mine, i)
    )


def _index(torch, device: str) -> int:
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _uuid(torch, index: int) -> str:
    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"
