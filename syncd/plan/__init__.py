"""Transfer planning: pure functions of the catalogs and the topology."""

from syncd.plan.planner import DEFAULT_BUCKET_BYTES, landing_order, make_plan
from syncd.plan.types import Bucket, DestMember, LinkSummary, Plan, SourceMember, TransferUnit

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "DestMember",
    "LinkSummary",
    "Plan",
    "SourceMember",
    "TransferUnit",
    "landing_order",
    "make_plan",
]
