"""The member side: the library that runs inside every trainer rank and generator worker.

`join(...)` (`syncd.member.membership`) is the front door: it registers a `MemberClient` with
syncd and starts a `MemberAgent` that carries out syncd's commands through the member's
endpoint, and returns a `Membership` to close. Below it, the client watches the commands, the
agent runs them, and the data plane (`dataplane`) moves the buckets. It imports the shared
vocabulary (`syncd.commands`, `syncd.states`, `syncd.vocabulary`, `syncd.layout`, `syncd.plan`,
`syncd.api`), never the daemon (`syncd.daemon`).

`join` and `Membership` are loaded on first use, so that code which only needs the data plane
(a standalone trainer packing an export, the FP8 quantizer) does not import grpc and the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from syncd.member.membership import Membership, join

__all__ = ["Membership", "join"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from syncd.member import membership

        return getattr(membership, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
