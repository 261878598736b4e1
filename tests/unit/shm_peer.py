"""A member process for the shared-memory fault tests: joins a two-rank gloo group as `rank`, wraps
it in `ShmTransport`, moves one 1 MiB bucket to or from rank `1 - rank`, prints "moved", then
blocks on stdin (the test kills it there, mid-refit: its segment names still in /dev/shm).

    python -m tests.unit.shm_peer ADDRESS RANK
"""

from __future__ import annotations

import sys

from syncd.member.dataplane import GlooTransport
from syncd.member.dataplane.shm import ShmTransport

NBYTES = 1 << 20


def main() -> None:
    address, rank = sys.argv[1], int(sys.argv[2])
    transport = ShmTransport(GlooTransport.connect(address, rank, 2, "faults", 30), [1 - rank], "faults", 30)
    buf = transport.allocate(NBYTES)
    if rank == 0:
        buf.fill_(7)
        transport.isend(buf, 1).wait(30)
    else:
        transport.irecv(buf, 0).wait(30)
    print("moved", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
