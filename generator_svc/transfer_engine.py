"""A vLLM weight-transfer engine fed by this worker's syncd member, in either refit mode.

Registered with vLLM's `WeightTransferEngineFactory` as `syncd_staging` when the worker extension is
imported (inside every worker, before the model loads). It drives vLLM's own lifecycle, so vLLM's
post-processing runs exactly as for a checkpoint load, without the trip through its loaders:

    start_weight_update   -> initialize_layerwise_reload (parameters back to checkpoint format, meta);
                             inplace: also the `InplaceReceiver` the data plane will write into
    update_weights(info)  -> staged: `install.install_into_model`, one copy per parameter from
                             staging, then each layer's post-processing once (CPU repack, MoE prepack
                             with `cpu_moe_fix`); `load_weights` only for layers it cannot cover.
                             After a delta refit only the layers whose parameters changed.
                             inplace: nothing left to install; checks every layer was
    finish_weight_update  -> finalize_layerwise_reload

The bytes never travel through `update_weights`: `info` only names the version. In staged mode the
data plane has written them into staging before the lifecycle; in inplace mode it writes them
between start and update, while generation is held.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from generator_svc import install
from generator_svc.inplace import InplaceReceiver
from generator_svc.staging import Staging
from syncd.layout import Catalog

BACKEND = "syncd_staging"


@dataclass
class StagingInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class StagingUpdateInfo(WeightTransferUpdateInfo):
    version: str


class StagingTransferEngine(WeightTransferEngine[StagingInitInfo, StagingUpdateInfo]):
    init_info_cls = StagingInitInfo
    update_info_cls = StagingUpdateInfo
    supports_draft_weight_update = False

    # Set by the worker extension's ws_setup: staging (staged mode) or the catalog (inplace mode).
    staging: Staging | None = None
    inplace_catalog: Catalog | None = None
    receiver: InplaceReceiver | None = None  # inplace: from start_weight_update to finish
    last_install: install.InstallReport | None = None

    def init_transfer_engine(self, init_info: StagingInitInfo) -> None:
        """Nothing to connect: the data plane is owned by the worker's syncd member."""

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.staging is None and self.inplace_catalog is None:
            raise RuntimeError("weight sync is not set up on this worker (ws_setup was not called)")
        if self.staging is not None:
            self.staging.require_complete()
        initialize_layerwise_reload(self.model)
        if self.inplace_catalog is not None:
            self.receiver = InplaceReceiver(self.model, self.inplace_catalog, self.device, self.vllm_config)

    def receive_weights(self, update_info: StagingUpdateInfo) -> None:
        """Install staging into the parameters by copies (`generator_svc.install`); only layers the
        catalog cannot cover completely go through vLLM's loaders (logged, reported). In inplace
        mode the receiver installed every layer as it arrived; only its completeness is checked."""
        if self.receiver is not None:
            self.receiver.require_complete()
            self.last_install = self.receiver.report
            return
        assert self.staging is not None
        report = install.install_into_model(self.model, self.staging.buffers, self.staging.changed)
        if report.fallback_params:
            fallback = set(report.fallback_params)
            # vLLM's models define load_weights; to nn.Module's stub an attribute is Tensor | Module.
            loaded = set(self.model.load_weights(self.staging.hf_weights(fallback)))  # type: ignore[operator]  # vLLM model's method
            missed = sorted(fallback - loaded)
            if missed:
                raise RuntimeError(f"version {update_info.version}: vLLM's loaders did not load {missed[:5]}")
        self.last_install = report

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self.receiver = None
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        """No resources of its own."""


def register() -> None:
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, StagingTransferEngine)
