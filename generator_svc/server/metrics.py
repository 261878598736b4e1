"""generator_svc's own metrics (`weightsync_generator_*`), exported on vLLM's /metrics (default registry)."""

from __future__ import annotations

from enum import StrEnum

from prometheus_client import Counter, Gauge, Histogram

REFITS = Counter("weightsync_generator_refits", "Refits applied by this generator, by outcome", ["outcome"])
STAGE_SECONDS = Histogram("weightsync_generator_stage_seconds", "Time to stage one version from a file")
APPLY_SECONDS = Histogram(
    "weightsync_generator_apply_seconds", "Time generation was held for one update (pause to resume)"
)
INSTALL_SECONDS = Histogram(
    "weightsync_generator_install_seconds",
    "Time the engine was paused for one update (pause in effect to resume): the part of the apply "
    "time that is the install itself",
)
SPANNING_REQUESTS = Counter(
    "weightsync_generator_spanning_requests",
    "Requests whose output tokens came from more than one weight version (--pause-mode keep), "
    "counted once per version switch when they finish",
)
STAGED_BYTES = Counter("weightsync_generator_staged_bytes", "Bytes staged across all workers")
CATALOG_BYTES = Gauge(
    "weightsync_generator_catalog_bytes", "Bytes of the parameters registered by all workers"
)
WEIGHT_VERSION = Gauge(
    "weightsync_generator_weight_version", "Committed weight version (labels that are trainer versions only)"
)
SERVING = Gauge(
    "weightsync_generator_serving", "1 when generation is allowed (not torn by a failed in-lifecycle update)"
)
INSTALL_FALLBACK_PARAMS = Counter(
    "weightsync_generator_install_fallback_params",
    "Parameters installed through vLLM's loaders because the install by "
    "parameter could not cover their layer (named in the log)",
)
ENGINE_ALIVE = Gauge(
    "weightsync_generator_engine_alive",
    "1 while the vLLM engine runs; 0 once it died (the generator answers 503 and exits soon after)",
)
ENGINE_DEATHS = Counter(
    "weightsync_generator_engine_deaths", "Deaths of the vLLM engine seen by this generator"
)


class RejectReason(StrEnum):
    """Why a generation request was refused before the engine (the `reason` label)."""

    INVALID = "invalid"  # 400
    TOO_LARGE = "too_large"  # 413
    OVERLOADED = "overloaded"  # 429
    ENGINE_DEAD = "engine_dead"  # 503


REJECTED_REQUESTS = Counter(
    "weightsync_generator_rejected_requests",
    "Generation requests refused before the engine, by reason: invalid (400), too_large (413), "
    "overloaded (429), engine_dead (503)",
    ["reason"],
)
# Every reason is exported from the start, at 0: a series that appears only at its first refusal
# has no rate() over the window before it, and dashboards and alerts would see "no data".
for _reason in RejectReason:
    REJECTED_REQUESTS.labels(reason=_reason)
