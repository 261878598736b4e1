"""The data plane: bucket packing, checksums, transports (gloo, NCCL) and the send/recv loops."""

from syncd.dataplane.checksum import checksum
from syncd.dataplane.executor import TransferAborted, TransferStats, recv_buckets, send_buckets
from syncd.dataplane.pack import catalog_views, pack_into, unpack_from
from syncd.dataplane.prepared import ReceiveSink
from syncd.dataplane.transport import GlooTransport, TransferError, TransferTimeout, Transport

__all__ = [
    "GlooTransport",
    "ReceiveSink",
    "TransferAborted",
    "TransferStats",
    "TransferError",
    "TransferTimeout",
    "Transport",
    "catalog_views",
    "checksum",
    "pack_into",
    "recv_buckets",
    "send_buckets",
    "unpack_from",
]
