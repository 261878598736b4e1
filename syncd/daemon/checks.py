"""The checks that decide whether a refit may start and whether its members' reports agree with
its plan. Pure functions of the members, catalogs, plans and reports: each returns what is wrong,
naming the member, tensor or value (None or empty when nothing is), and the caller decides what a
problem means (a refusal at registration, a 409 for a trigger, an abort mid-refit).

- `dtype_mismatch`: a generator could never receive the trainers' weights (checked at
  registration and for readiness).
- `refit_problems`: why a refit could not start now (readiness, trigger, PREPARING).
- `plan_problem`: a plan a refit cannot run (PREPARING).
- `transfer_report_problem`: TRANSFERRED reports against the plan's bytes (TRANSFERRING).
- `checksum_mismatch`: receivers' checksums against their senders' (VERIFYING).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from syncd.commands import MemberReport, checksum_key
from syncd.daemon.errors import FailedPrecondition
from syncd.daemon.registry import ROLES, Member
from syncd.layout import Catalog, dtypes
from syncd.plan import Plan, fp8_blocks
from syncd.vocabulary import Role


def dtype_mismatch(generator_id: str, generator: Catalog, trainers: Sequence[Catalog]) -> str | None:
    """Why `generator` cannot receive what the trainers send, dtype-wise, or None. Senders convert
    while packing where `dtypes.conversion` allows it (float32 -> bfloat16, say); any other pair is
    refused here, at registration, rather than when a refit runs. Blockwise-FP8 weights come from
    the sender's quantizer (`syncd.plan.fp8_blocks`); the planner checks their blocks."""
    sent = {c.name: c.dtype for catalog in trainers for c in catalog.canonical}
    for c in generator.canonical:
        want = sent.get(c.name)
        if want is None or fp8_blocks.quantizes(c.name, want, c.dtype):
            continue
        try:
            dtypes.conversion(want, c.dtype, tensor=c.name)
        except ValueError as e:
            return (
                f"{generator_id} holds {c.name} as {c.dtype} but the trainers send {want} ({e}): "
                f"start the generator with --dtype {want}"
            )
    return None


def refit_problems(
    members: Sequence[Member],
    expected: Mapping[Role, int],
    run_id: str | None,
    catalog: Callable[[str], Catalog],
    plan: Callable[[], object],
) -> list[str]:
    """Why a refit could not start now (empty: it could). `plan()` raises FailedPrecondition when
    the registered members cannot be planned for; it runs only when nothing else is wrong."""
    counts = Counter(m.role for m in members)
    problems = [f"{counts[r]} of {expected[r]} {r}s registered" for r in ROLES if counts[r] < expected[r]]
    stale = sorted(m.member_id for m in members if m.role == Role.TRAINER and m.run_id != run_id)
    if stale:
        problems.append(
            f"trainers {', '.join(stale)} belong to a superseded training run (the current run is {run_id!r})"
        )
    trainers = [catalog(m.catalog_hash) for m in members if m.role == Role.TRAINER]
    problems += [
        p
        for m in members
        if m.role == Role.GENERATOR
        if (p := dtype_mismatch(m.member_id, catalog(m.catalog_hash), trainers))
    ]
    if not problems:  # ready means a refit could start now: GET /v1/plan must agree
        try:
            plan()
        except FailedPrecondition as e:
            problems.append(str(e))
    return problems


def plan_problem(plan: Plan) -> str | None:
    """Why a refit cannot run `plan`, or None."""
    if not plan.buckets:
        return "the plan moves no bytes: the registered catalogs hold no tensors to move"
    return None


def transfer_report_problem(
    plan: Plan, reports: Mapping[str, MemberReport], delta_dsts: frozenset[str] = frozenset()
) -> str | None:
    """What is wrong with the members' TRANSFERRED reports, judged against the plan, or None.
    Every member must report exactly the bytes its part of the plan moves (at most those, on delta
    links: their size depends on what changed), and sane timings."""
    problems = []
    for member_id, report in sorted(reports.items()):
        buckets = plan.for_member(member_id)
        expected = sum(b.nbytes for b in buckets)
        delta = any(b.dst in delta_dsts for b in buckets)
        if report.bytes > expected if delta else report.bytes != expected:
            problems.append(
                f"member {member_id} reported {report.bytes} bytes, its part of the plan moves {expected}"
            )
        bad = {k: v for k, v in report.timings.items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            problems.append(f"member {member_id} reported timings out of range: {bad}")
    return _first(problems)


def checksum_mismatch(plan: Plan, checksums: Mapping[str, Mapping[str, str]]) -> str | None:
    """Compare, unit by unit, what each receiver reported with what its bucket's origin (the
    sender that packed the bytes; a relay only forwards them) reported. `checksums[member][key]`.
    Returns an error naming the first bad tensor region, or None."""
    problems = []
    for b in plan.buckets:
        sent, got = checksums.get(b.origin, {}), checksums.get(b.dst, {})
        for u in b.units:
            key = checksum_key(u.canonical, u.canon)
            if key not in sent:
                problems.append(f"sender {b.origin} reported no checksum for {key} (tensor {u.canonical})")
            elif key not in got:
                problems.append(f"receiver {b.dst} reported no checksum for {key} (tensor {u.canonical})")
            elif sent[key] != got[key]:
                problems.append(
                    f"checksum mismatch for tensor {u.canonical} region {u.canon}: sender {b.origin} "
                    f"{sent[key]}, receiver {b.dst} {got[key]}"
                )
    return _first(problems)


def _first(problems: Sequence[str]) -> str | None:
    """The first problem, and how many more there are: one line for a log, a record, a 409."""
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more
