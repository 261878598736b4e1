"""ExecutePlan: one thread per stage group, all stages concurrently, each sending, receiving or
relaying its buckets (`stage_loops`); then TRANSFERRED with bytes, per-unit checksums and timings.

A stage whose loop fails closes its group, so that its peers fail fast instead of waiting out
their timeout, and its error names the member at the other end when the transport knows it.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from syncd.commands import ExecutePlan, Phase
from syncd.member.agent.endpoint import Endpoint, Reporter
from syncd.member.agent.groups import JoinedGroups
from syncd.member.agent.loop_args import RefitTransfer, StageTransfer
from syncd.member.agent.stage_loops import run_stage_loop
from syncd.member.dataplane import TransferError, TransferStats, TransferTimeout
from syncd.member.dataplane.delta import DeltaStats
from syncd.plan.types import Bucket

log = logging.getLogger(__name__)

_Results = dict[int, TransferStats | BaseException]


def naming_peer(error: BaseException, members: Sequence[str]) -> BaseException:
    """A transport error with the member at the other end named, so that syncd's abort says which
    member was slow, stuck or gone (the transport knows only its group rank)."""
    peer = getattr(error, "peer", None)
    if not isinstance(error, TransferError) or peer is None or not 0 <= peer < len(members):
        return error
    what = "is slow or stuck" if isinstance(error, TransferTimeout) else "failed or is gone"
    return TransferError(f"{error}: {members[peer]} {what}", peer)


def transfer(
    refit: RefitTransfer, cmd: ExecutePlan, groups: JoinedGroups, endpoint: Endpoint, client: Reporter
) -> None:
    """Runs this member's part of the plan and reports it (TRANSFERRED); raises the first
    stage's failure instead."""
    totals = _Totals.of(_run_stages(refit, cmd, groups))
    if refit.diffs is None and refit.delta is not None and hasattr(endpoint, "received_delta"):
        endpoint.received_delta(cmd.refit_id, frozenset(totals.touched))
    client.report(
        cmd.refit_id,
        Phase.TRANSFERRED,
        bytes=totals.bytes,
        checksums=totals.checksums,
        timings=totals.timings,
        delta_elements=totals.elements,
        changed_elements=totals.changed,
    )


def _run_stages(refit: RefitTransfer, cmd: ExecutePlan, groups: JoinedGroups) -> dict[int, TransferStats]:
    per_stage: dict[int, list[Bucket]] = defaultdict(list)
    for b in cmd.buckets:
        per_stage[b.stage].append(b)
    expected = {g.stage: g.group_id for g in cmd.groups}
    results: _Results = {}
    threads = []
    for stage, buckets in per_stage.items():
        group = groups.get(stage)
        if group is None or (stage in expected and expected[stage] != group.group_id):
            raise RuntimeError(f"{refit.member_id} has not joined the group of stage {stage}")
        t = threading.Thread(
            target=_run_stage,
            args=(refit.stage(stage, group, buckets), groups, results),
            name=f"{refit.member_id}-stage{stage}",
        )
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    stats: dict[int, TransferStats] = {}
    for stage, result in results.items():
        if isinstance(result, BaseException):
            raise result
        stats[stage] = result
    return stats


def _run_stage(s: StageTransfer, groups: JoinedGroups, results: _Results) -> None:
    try:
        results[s.stage] = run_stage_loop(s)
    except BaseException as e:  # noqa: BLE001 - a stage thread's failure goes to `results`, read after join
        log.warning("%s: stage %d transfer failed: %s", s.refit.member_id, s.stage, e)
        groups.close(s.stage)  # unblock our peers: they fail fast instead of timing out
        results[s.stage] = naming_peer(e, s.group.members)


@dataclass
class _Totals:
    """What TRANSFERRED reports: the stages' stats summed, and the slowest stage's time."""

    bytes: int = 0
    checksums: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    elements: int = 0  # delta loops: their units' elements,
    changed: int = 0  # how many of them changed,
    touched: set[str] = field(default_factory=set)  # and the tensors they changed

    @staticmethod
    def of(results: dict[int, TransferStats]) -> _Totals:
        t = _Totals()
        for stage, stats in results.items():
            t.checksums.update(stats.checksums)
            t.bytes += stats.bytes
            t.timings[f"stage{stage}_s"] = stats.seconds
            if isinstance(stats, DeltaStats):
                t.elements, t.changed = t.elements + stats.elements, t.changed + stats.changed
                t.touched |= stats.touched
        t.timings["transfer_s"] = max(t.timings.values(), default=0.0)
        return t
