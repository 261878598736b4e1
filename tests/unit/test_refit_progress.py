"""A refit's progress as syncd computes it (`syncd.daemon.progress`), on a clock the test moves:
rates and ETAs from the reports, the slowest link named, a relay's link included; and the
transfer model (`syncd.daemon.transfer_model`) fitted on past refits."""

from __future__ import annotations

import pytest

from syncd.commands import ProgressReport
from syncd.daemon.metrics import Metrics
from syncd.daemon.progress import EtaSource, TransferProgress
from syncd.daemon.transfer_model import Observation, fit
from syncd.plan.types import Bucket, Plan, Relay
from syncd.states import RefitState

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _plan() -> Plan:
    """trainer-0 sends 8 MiB to generator-0-0, which relays them to generator-1-0; trainer-0 also
    sends 4 MiB to generator-0-1."""
    buckets = [Bucket(0, "trainer-0", "generator-0-0", i, (), MIB) for i in range(8)]
    buckets += [
        Bucket(0, "generator-0-0", "generator-1-0", i, (), MIB, Relay("trainer-0", ("trainer-0", "x", i)))
        for i in range(8)
    ]
    buckets += [Bucket(0, "trainer-0", "generator-0-1", i, (), MIB) for i in range(4)]
    return Plan(tuple(buckets), MIB)


def test_rates_eta_and_the_slowest_link_from_running_totals() -> None:
    clock = Clock()
    progress = TransferProgress("refit-1", _plan(), estimate_s=None, after_s=1.0, clock=clock)
    assert progress.snapshot(RefitState.TRANSFERRING).eta_source == EtaSource.NONE
    clock.now += 4
    progress.add(ProgressReport("generator-0-0", "refit-1", {(0, "trainer-0"): 4 * MIB}))
    progress.add(ProgressReport("generator-1-0", "refit-1", {(0, "generator-0-0"): 2 * MIB}))
    progress.add(ProgressReport("generator-0-1", "refit-1", {(0, "trainer-0"): 4 * MIB}))
    progress.add(ProgressReport("generator-0-0", "refit-1", {(0, "trainer-0"): 3 * MIB}))  # late: ignored
    p = progress.snapshot(RefitState.TRANSFERRING)
    assert (p.total.done, p.total.total) == (10 * MIB, 20 * MIB)
    assert p.members["generator-0-0"].done == 4 * MIB and p.members["generator-0-1"].fraction == 1.0
    # The relay's link moves at 0.5 MiB/s with 6 MiB left: 12 s, the latest, plus verify and commit.
    assert p.slowest is not None and (p.slowest.src, p.slowest.dst) == ("generator-0-0", "generator-1-0")
    assert p.slowest.relay and p.slowest.eta_s == pytest.approx(12.0)
    assert p.eta_source == EtaSource.LIVE and p.eta_s == pytest.approx(13.0)

    progress.member_done("generator-1-0")
    progress.member_done("generator-0-0")
    progress.conclude(RefitState.COMMITTED)
    final = progress.snapshot(RefitState.COMMITTED)
    assert final.total.fraction == 1.0 and final.slowest is None and final.eta_s is None


def test_before_any_byte_the_eta_is_the_models_less_the_time_spent() -> None:
    clock = Clock()
    progress = TransferProgress("refit-2", _plan(), estimate_s=10.0, after_s=0.5, clock=clock)
    clock.now += 3
    p = progress.snapshot(RefitState.TRANSFERRING)
    assert p.eta_source == EtaSource.MODEL and p.eta_s == pytest.approx(7.0)
    assert p.since_progress_s == pytest.approx(3.0)


def test_the_model_fits_an_overhead_and_a_link_bandwidth() -> None:
    observations = [Observation(n * MIB, 2.0 + n / 10, 0.5) for n in (10, 20, 40)]  # 10 MiB/s, 2 s
    f = fit(observations)
    assert f is not None
    assert f.overhead_s == pytest.approx(2.0) and f.bandwidth == pytest.approx(10 * MIB)
    assert f.seconds(100 * MIB) == pytest.approx(2.0 + 10.0 + 0.5)
    one = fit([Observation(10 * MIB, 2.0, 0.0)])  # one size: no overhead to tell apart
    assert one is not None and one.overhead_s == 0 and one.bandwidth == pytest.approx(5 * MIB)
    assert fit([]) is None


def test_the_stall_gauge_counts_only_while_the_refit_transfers() -> None:
    """Verify and commit move no bytes: the seconds without progress (what the stall alert reads)
    stay 0 after the transfer, while the refit is still in flight."""
    clock = Clock()
    progress = TransferProgress("refit-3", _plan(), estimate_s=None, after_s=0.0, clock=clock)
    clock.now += 20
    metrics = Metrics()
    metrics.show_progress(progress.snapshot(RefitState.TRANSFERRING), in_flight=True)
    assert "weightsync_syncd_refit_since_progress_seconds 20.0" in metrics.render().decode()
    metrics.show_progress(progress.snapshot(RefitState.VERIFYING), in_flight=True)
    shown = metrics.render().decode()
    assert "weightsync_syncd_refit_since_progress_seconds 0.0" in shown
    assert "weightsync_syncd_refit_in_flight 1.0" in shown
