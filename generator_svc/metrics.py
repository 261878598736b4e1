"""generator_svc's own metrics (`weightsync_generator_*`), exported on vLLM's /metrics (default registry)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REFITS = Counter("weightsync_generator_refits", "Refits applied by this generator, by outcome", ["outcome"])
STAGE_SECONDS = Histogram("weightsync_generator_stage_seconds", "Time to stage one version from a file")
APPLY_SECONDS = Histogram(
    "weightsync_generator_apply_seconds", "Time generation was held for one update (pause to resume)"
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
