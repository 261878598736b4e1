"""The data plane: bucket packing, checksums, transports (gloo, NCCL) and the send/recv loops."""

from syncd.member.dataplane.checksum import checksum
from syncd.member.dataplane.executor import TransferAborted, TransferStats, recv_buckets, send_buckets
from syncd.member.dataplane.gc_pause import GcPause
from syncd.member.dataplane.loop_options import LoopCache, LoopOptions
from syncd.member.dataplane.pack import catalog_views, pack_into, unpack_from
from syncd.member.dataplane.prepared import ReceiveSink
from syncd.member.dataplane.transport import (
    ConcurrentUse,
    GlooTransport,
    GroupSender,
    TransferError,
    TransferTimeout,
    Transport,
)

__all__ = [
    "ConcurrentUse",
    "GcPause",
    "GlooTransport",
    "GroupSender",
    "LoopCache",
    "LoopOptions",
    "ReceiveSink",
    "TransferAborted",
    "TransferError",
    "TransferStats",
    "TransferTimeout",
    "Transport",
    "catalog_views",
    "checksum",
    "pack_into",
    "recv_buckets",
    "send_buckets",
    "unpack_from",
]
