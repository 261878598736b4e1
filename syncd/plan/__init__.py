"""Transfer planning: pure functions of the catalogs and the topology."""

from syncd.plan.fanout import DEFAULT_FANOUT, make_fanout_plan, replica_sets
from syncd.plan.planner import DEFAULT_BUCKET_BYTES, landing_order, make_plan
from syncd.plan.types import Bucket, DestMember, LinkSummary, Plan, Relay, SourceMember, TransferUnit

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_FANOUT",
    "Bucket",
    "DestMember",
    "LinkSummary",
    "Plan",
    "Relay",
    "SourceMember",
    "TransferUnit",
    "landing_order",
    "make_fanout_plan",
    "make_plan",
    "replica_sets",
]
