"""The checks that decide whether a refit may start and whether its reports agree with its plan
(`syncd.daemon.checks`): pure functions, so each is tried here on small hand-made catalogs and
reports, and must name the member, tensor or value that is wrong."""

from __future__ import annotations

import math

import pytest

from syncd.commands import MemberReport, Phase, checksum_key
from syncd.daemon.checks import (
    checksum_mismatch,
    dtype_mismatch,
    plan_problem,
    refit_problems,
    transfer_report_problem,
)
from syncd.daemon.errors import FailedPrecondition
from syncd.daemon.registry import Member
from syncd.layout import Canon, CanonicalTensor, Catalog, local_tensor
from syncd.plan import DestMember, Plan, SourceMember, make_plan


def catalog(dtype: str) -> Catalog:
    w = CanonicalTensor("w", (64, 8), dtype)
    return Catalog((w,), (local_tensor("w", dtype, Canon(w.name, w.shape)),))


CATALOGS = {f"hash-{d}": catalog(d) for d in ("float32", "bfloat16", "int8")}
PLAN = make_plan(
    [SourceMember("t", 0, CATALOGS["hash-float32"])],
    [DestMember(g, CATALOGS["hash-bfloat16"]) for g in ("g1", "g2")],
)
PER_GENERATOR = 64 * 8 * 2  # bfloat16 bytes each generator receives


def member(member_id: str, role: str, dtype: str = "float32", run_id: str = "run-a") -> Member:
    return Member(member_id, role, {"pp": 0}, "cpu", "127.0.0.1", f"hash-{dtype}", "s1", 0.0, run_id)


@pytest.mark.parametrize(
    ("trainer", "generator", "problem"),
    [
        ("float32", "float32", None),
        ("float32", "bfloat16", None),  # the sender converts while packing
        ("bfloat16", "float32", None),
        ("float32", "int8", "g1 holds w as int8 but the trainers send float32"),
    ],
)
def test_a_generator_whose_dtypes_the_trainers_cannot_send_is_named(
    trainer: str, generator: str, problem: str | None
) -> None:
    found = dtype_mismatch("g1", catalog(generator), [catalog(trainer)])
    if problem is None:
        assert found is None
    else:
        assert found is not None and found.startswith(problem) and "--dtype float32" in found


def plannable() -> Plan:
    return PLAN


def unplannable() -> Plan:
    raise FailedPrecondition("cannot plan for the registered members: no")


@pytest.mark.parametrize(
    ("members", "run_id", "plan", "problems"),
    [
        ([member("t", "trainer"), member("g1", "generator", "bfloat16")], "run-a", plannable, []),
        ([member("t", "trainer")], "run-a", plannable, ["0 of 1 generators registered"]),
        (
            [member("t", "trainer"), member("g1", "generator")],
            "run-b",
            plannable,
            ["trainers t belong to a superseded training run (the current run is 'run-b')"],
        ),
        (
            [member("t", "trainer"), member("g1", "generator")],
            "run-a",
            unplannable,
            ["cannot plan for the registered members: no"],
        ),
        # The plan is tried only when nothing else is wrong.
        ([member("g1", "generator")], "run-a", unplannable, ["0 of 1 trainers registered"]),
    ],
)
def test_why_a_refit_could_not_start(members, run_id, plan, problems) -> None:
    expected = {"trainer": 1, "generator": 1}
    assert refit_problems(members, expected, run_id, CATALOGS.__getitem__, plan) == problems


def test_a_generator_that_cannot_receive_keeps_a_refit_from_starting() -> None:
    members = [member("t", "trainer"), member("g1", "generator", "int8")]
    [problem] = refit_problems(
        members, {"trainer": 1, "generator": 1}, "run-a", CATALOGS.__getitem__, plannable
    )
    assert problem.startswith("g1 holds w as int8")


def test_a_plan_that_moves_nothing_cannot_run() -> None:
    assert plan_problem(PLAN) is None
    assert plan_problem(Plan((), 1024)) == (
        "the plan moves no bytes: the registered catalogs hold no tensors to move"
    )


def transferred(member_id: str, nbytes: int, **timings: float) -> MemberReport:
    return MemberReport(member_id, "refit-1", Phase.TRANSFERRED, bytes=nbytes, timings=timings)


SENT = 2 * PER_GENERATOR


@pytest.mark.parametrize(
    ("reports", "delta", "problem"),
    [
        (
            [transferred("t", SENT), transferred("g1", PER_GENERATOR), transferred("g2", PER_GENERATOR)],
            (),
            None,
        ),
        (
            [transferred("t", SENT), transferred("g1", PER_GENERATOR - 1)],
            (),
            f"member g1 reported {PER_GENERATOR - 1} bytes, its part of the plan moves {PER_GENERATOR}",
        ),
        # On a delta link fewer bytes travel (only what changed), never more.
        ([transferred("t", 100), transferred("g1", 100)], ("g1",), None),
        (
            [transferred("g1", PER_GENERATOR + 1)],
            ("g1",),
            f"member g1 reported {PER_GENERATOR + 1} bytes, its part of the plan moves {PER_GENERATOR}",
        ),
        (
            [transferred("g1", PER_GENERATOR, transfer=math.nan), transferred("g2", 0, transfer=-1.0)],
            (),
            "member g1 reported timings out of range: {'transfer': nan} (and 2 more)",
        ),
    ],
)
def test_transfer_reports_must_move_the_planned_bytes(reports, delta, problem) -> None:
    by_member = {r.member_id: r for r in reports}
    assert transfer_report_problem(PLAN, by_member, frozenset(delta)) == problem


def plan_checksums() -> dict[str, dict[str, str]]:
    """Every unit's checksum as both its sender and its receiver report it, all equal."""
    sums: dict[str, dict[str, str]] = {}
    for b in PLAN.buckets:
        for u in b.units:
            key = checksum_key(u.canonical, u.canon)
            sums.setdefault(b.src, {})[key] = sums.setdefault(b.dst, {})[key] = f"sum-of-{key}"
    return sums


def test_checksums_that_agree_pass_and_one_that_differs_names_the_tensor_and_both_members() -> None:
    sums = plan_checksums()
    assert checksum_mismatch(PLAN, sums) is None
    key = next(iter(sums["g2"]))
    sums["g2"][key] = "other"
    problem = checksum_mismatch(PLAN, sums)
    assert problem is not None
    assert problem.startswith("checksum mismatch for tensor w region ")
    assert f"sender t sum-of-{key}, receiver g2 other" in problem


def test_a_missing_checksum_names_who_did_not_report_it() -> None:
    sums = plan_checksums()
    key = next(iter(sums["g1"]))
    del sums["g1"][key]
    assert checksum_mismatch(PLAN, sums) == f"receiver g1 reported no checksum for {key} (tensor w)"
    sums = plan_checksums()
    sums["t"] = {}
    problem = checksum_mismatch(PLAN, sums)
    assert problem is not None and problem.startswith("sender t reported no checksum for w[")
    assert problem.endswith(f"(and {sum(len(b.units) for b in PLAN.buckets) - 1} more)")
