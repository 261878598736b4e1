"""Every Prometheus metric syncd exports, declared here and nowhere else.

Each daemon owns a registry (several daemons may live in one test process).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from syncd.daemon.progress import RefitProgress
from syncd.states import RefitState
from syncd.vocabulary import Role

# `*_created` series only double the output; nothing here needs them.
disable_created_metrics()

DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.members = Gauge(
            "weightsync_syncd_members", "Registered members with a live lease", ["role"], registry=r
        )
        self.refits = Counter(
            "weightsync_syncd_refits", "Finished refits by outcome", ["outcome"], registry=r
        )
        self.refit_duration = Histogram(
            "weightsync_syncd_refit_duration_seconds",
            "Trigger to COMMITTED/ABORTED",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.phase_duration = Histogram(
            "weightsync_syncd_phase_duration_seconds",
            "Duration of each refit phase",
            ["phase"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.bytes_moved = Counter(
            "weightsync_syncd_moved_bytes", "Bytes received by generators in committed refits", registry=r
        )
        self.refit_mode = Counter(
            "weightsync_syncd_committed_refits_by_mode",
            "Committed refits, delta (some generator received only what changed) or full",
            ["mode"],
            registry=r,
        )
        self.delta_saved_bytes = Counter(
            "weightsync_syncd_delta_saved_bytes",
            "Bytes of the full plan that delta refits did not move to generators",
            registry=r,
        )
        self.changed_fraction = Gauge(
            "weightsync_syncd_delta_changed_ratio",
            "Fraction of the elements on delta links that changed, in the last committed delta refit",
            registry=r,
        )
        self.insecure_no_auth = Gauge(
            "weightsync_syncd_insecure_no_auth",
            "1 when syncd serves without a token by --insecure-no-auth (anyone who reaches it may "
            "trigger refits or join as a member), else 0",
            registry=r,
        )
        self.missing_generators = Gauge(
            "weightsync_syncd_missing_generators",
            "Generator workers registered once and not now (refits go on without them while every "
            "layout keeps --min-replicas-per-layout whole replicas)",
            registry=r,
        )
        self.committed_version = Gauge(
            "weightsync_syncd_committed_weight_version", "Weight version generators serve", registry=r
        )
        self.adapter_bytes = Counter(
            "weightsync_syncd_adapter_moved_bytes",
            "Bytes received into generators' adapter slots in committed refits of each named adapter "
            "(counted in weightsync_syncd_moved_bytes too)",
            ["adapter"],
            registry=r,
        )
        self.adapter_version = Gauge(
            "weightsync_syncd_adapter_committed_version",
            "Version of each named adapter the generators' slots hold",
            ["adapter"],
            registry=r,
        )
        self._progress_gauges()
        for role in Role:
            self.members.labels(role=role)
        for outcome in ("committed", "aborted"):
            self.refits.labels(outcome=outcome)
        for mode in ("full", "delta"):
            self.refit_mode.labels(mode=mode)

    def _progress_gauges(self) -> None:
        """The refit in flight (`syncd.daemon.progress`), as the last scrape found it."""
        r = self.registry
        self.refit_in_flight = Gauge(
            "weightsync_syncd_refit_in_flight",
            "1 from the start of a refit's transfer until it ends, else 0 (the other refit_ and "
            "link_ gauges then show the last refit as it ended)",
            registry=r,
        )
        self.refit_done_bytes = Gauge(
            "weightsync_syncd_refit_done_bytes",
            "Bytes the refit in flight (else the last) moved, all links",
            registry=r,
        )
        self.refit_total_bytes = Gauge(
            "weightsync_syncd_refit_total_bytes",
            "Bytes the refit in flight (else the last) moves, all links",
            registry=r,
        )
        self.refit_eta = Gauge(
            "weightsync_syncd_refit_eta_seconds",
            "Seconds until the refit in flight ends (NaN: no estimate yet, or none in flight)",
            registry=r,
        )
        self.refit_since_progress = Gauge(
            "weightsync_syncd_refit_since_progress_seconds",
            "Seconds since bytes of the refit in flight last arrived, while it transfers (else 0)",
            registry=r,
        )
        self.stall_timeout = Gauge(
            "weightsync_syncd_stall_timeout_seconds",
            "How long one data-plane wait may take before its member aborts the refit (--stall-timeout)",
            registry=r,
        )
        self.link_rate = Gauge(
            "weightsync_syncd_link_rate_bytes",
            "Bytes per second of each link of the refit in flight (else the last, as it ended)",
            ["stage", "src", "dst"],
            registry=r,
        )

    def show_progress(self, p: RefitProgress | None, in_flight: bool) -> None:
        """Set the progress gauges from the refit in flight, or (`in_flight` False) from the last
        one as it ended: its bytes and links stay on the dashboard, its ETA and stall do not."""
        self.refit_in_flight.set(in_flight)
        self.link_rate.clear()
        self.refit_eta.set(float("nan") if p is None or p.eta_s is None or not in_flight else p.eta_s)
        # Only a transfer stalls: verify and commit move no bytes, and no stall timeout waits on them.
        transferring = p is not None and in_flight and p.state == RefitState.TRANSFERRING
        self.refit_since_progress.set(p.since_progress_s if p is not None and transferring else 0)
        self.refit_done_bytes.set(0 if p is None else p.total.done)
        self.refit_total_bytes.set(0 if p is None else p.total.total)
        for link in p.links if p is not None else ():
            self.link_rate.labels(stage=str(link.stage), src=link.src, dst=link.dst).set(link.share.rate)

    def render(self) -> bytes:
        return generate_latest(self.registry)
