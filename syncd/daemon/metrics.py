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
        for role in Role:
            self.members.labels(role=role)
        for outcome in ("committed", "aborted"):
            self.refits.labels(outcome=outcome)
        for mode in ("full", "delta"):
            self.refit_mode.labels(mode=mode)

    def render(self) -> bytes:
        return generate_latest(self.registry)
