"""A vLLM weight-transfer engine fed by this worker's syncd member, in either refit mode.

Registered with vLLM's `WeightTransferEngineFactory` as `syncd_staging` when the worker extension is
imported (inside every worker, before the model loads). It drives vLLM's own lifecycle, so vLLM's
post-processing runs exactly as for a checkpoint load, without the trip through its loaders; what
differs by refit mode is the worker's `UpdateTarget` (`generator_svc.worker.worker_modes`):

    start_weight_update   -> target.before_reload (staged: staging is complete);
                             initialize_layerwise_reload (parameters back to checkpoint format, meta);
                             target.after_reload (inplace: the `InplaceReceiver` the data plane
                             will write into)
    update_weights(info)  -> target.install: staged: `install.install_into_model`, one copy per
                             parameter from staging, then each layer's post-processing once (CPU
                             repack, MoE prepack with the CPU MoE fix of `vllm_adapter`);
                             `load_weights` only for layers it cannot cover. After a delta
                             refit only the layers whose parameters changed. inplace: nothing
                             left to install; checks every layer was
    finish_weight_update  -> target.finish; finalize_layerwise_reload

The bytes never travel through `update_weights`: `info` only names the version. In staged mode the
data plane has written them into staging before the lifecycle; in inplace mode it writes them
between start and update, while generation is held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from generator_svc.settings import TRANSFER_BACKEND
from generator_svc.vllm_adapter import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    finalize_layerwise_reload,
    initialize_layerwise_reload,
    register_weight_transfer_engine,
)
from generator_svc.worker_protocol import WorkerInstall


@dataclass
class StagingInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class StagingUpdateInfo(WeightTransferUpdateInfo):
    version: str


class UpdateTarget(Protocol):
    """What one refit mode does inside the lifecycle on this worker (`worker_modes.WorkerMode`)."""

    def before_reload(self) -> None: ...

    def after_reload(self, model: torch.nn.Module, device: torch.device, vllm_config: Any) -> None: ...

    def install(self, model: torch.nn.Module, version: str) -> WorkerInstall: ...

    def finish(self) -> None: ...


class StagingTransferEngine(WeightTransferEngine[StagingInitInfo, StagingUpdateInfo]):
    init_info_cls = StagingInitInfo
    update_info_cls = StagingUpdateInfo
    supports_draft_weight_update = False

    # Set by the worker extension's ws_setup: the worker's refit mode.
    target: UpdateTarget | None = None
    last_install: WorkerInstall | None = None

    def init_transfer_engine(self, init_info: StagingInitInfo) -> None:
        """Nothing to connect: the data plane is owned by the worker's syncd member."""

    def start_weight_update(self) -> None:
        target = self._target()
        target.before_reload()
        initialize_layerwise_reload(self.model)
        target.after_reload(self.model, self.device, self.vllm_config)

    def receive_weights(self, update_info: StagingUpdateInfo) -> None:
        self.last_install = self._target().install(self.model, update_info.version)

    def finish_weight_update(self) -> None:
        if self.target is not None:
            self.target.finish()
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        """No resources of its own."""

    def _target(self) -> UpdateTarget:
        if self.target is None:
            raise RuntimeError("weight sync is not set up on this worker (ws_setup was not called)")
        return self.target


def register() -> None:
    register_weight_transfer_engine(TRANSFER_BACKEND, StagingTransferEngine)
