"""The two refit modes inside one vLLM worker, one object each behind `WorkerMode`.

The worker extension (`generator_svc.worker`) makes one at `ws_setup`, from `--refit-mode`, and
hands every mode-dependent `collective_rpc` call to it; the weight-transfer engine
(`generator_svc.worker.transfer_engine`) calls it inside vLLM's update lifecycle (`UpdateTarget`); the
syncd member receives through its `endpoint` (`generator_svc.worker.syncd_member`).

- `StagedWorker` owns this worker's staging (one buffer per local tensor, where the weights live,
  so the data plane writes with that device's transport and the install copies device to device).
  The install copies staging into the parameters by parameter (`generator_svc.worker.install`).
- `InplaceWorker` owns no second copy of the weights (the point of the mode): between the start of
  the lifecycle and its end it keeps the `InplaceReceiver` the data plane writes into.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from generator_svc.settings import RefitMode
from generator_svc.worker import install
from generator_svc.worker.inplace import InplaceReceiver
from generator_svc.worker.staging import Staging, StagingInputError
from generator_svc.worker.syncd_member import GeneratorEndpoint, InplaceEndpoint, StagedEndpoint
from generator_svc.worker_protocol import WorkerDigest, WorkerInstall
from syncd.layout import Catalog


class WorkerMode(Protocol):
    mode: RefitMode

    @property
    def endpoint(self) -> GeneratorEndpoint:
        """What the syncd member receives through (`generator_svc.worker.syncd_member`)."""
        ...

    def stage_file(self, path: str, refit_id: str) -> dict[str, int]:
        """Stage a checkpoint file (StagingInputError when there is nothing to stage it into)."""
        ...

    def status(self) -> tuple[str | None, list[str]]:
        """(what is ready to commit, or None; what of it is still missing)."""
        ...

    def drop_staged(self, refit_id: str) -> None: ...

    def hold(self, refit_id: str) -> None: ...

    def release(self) -> int:
        """Close an open install; how many layers it had installed."""
        ...

    def recover(self) -> None:
        """Before the workers put real tensors back after a failure: take no more bytes."""
        ...

    def committed(self, ok: bool) -> None: ...

    def digest(self, member_id: str) -> WorkerDigest:
        """The digest of the served version (`generator_svc.worker.digest`)."""
        ...

    # The weight-transfer engine's side (`transfer_engine.UpdateTarget`).

    def before_reload(self) -> None: ...

    def after_reload(self, model: torch.nn.Module, device: torch.device, vllm_config: Any) -> None: ...

    def install(self, model: torch.nn.Module, version: str) -> WorkerInstall: ...

    def finish(self) -> None: ...


class StagedWorker:
    mode = RefitMode.STAGED

    def __init__(
        self, catalog: Catalog, device: torch.device, member_id: str, relay: str, token: str
    ) -> None:
        self.staging = Staging(catalog, device=device)
        self.endpoint = StagedEndpoint(self.staging, member_id, relay, token)

    def stage_file(self, path: str, refit_id: str) -> dict[str, int]:
        self.staging.begin(refit_id)
        self.endpoint.served.overwritten(f"a checkpoint file was staged (refit {refit_id}), not by syncd")
        return self.staging.fill_from_safetensors(path)

    def digest(self, member_id: str) -> WorkerDigest:
        """What staging holds of the served version (`generator_svc.worker.digest`)."""
        return self.endpoint.served.digest(self.staging.buffers, member_id)

    def status(self) -> tuple[str | None, list[str]]:
        s = self.staging
        return s.refit_id, s.missing()[:10] if s.refit_id else []

    def drop_staged(self, refit_id: str) -> None:
        if not refit_id or self.staging.refit_id == refit_id:
            self.staging.discard()

    def hold(self, refit_id: str) -> None:
        raise RuntimeError("a staged worker never holds generation for a transfer")

    def release(self) -> int:
        return 0

    def recover(self) -> None:
        """Staging is separate memory: nothing was receiving into the engine."""

    def committed(self, ok: bool) -> None:
        if ok:
            self.staging.discard()

    def before_reload(self) -> None:
        self.staging.require_complete()

    def after_reload(self, model: torch.nn.Module, device: torch.device, vllm_config: Any) -> None:
        """Everything to install is in staging already."""

    def install(self, model: torch.nn.Module, version: str) -> WorkerInstall:
        """Install staging into the parameters by copies (`generator_svc.worker.install`); only layers the
        catalog cannot cover completely go through vLLM's loaders (logged, reported)."""
        report = install.install_into_model(model, self.staging.buffers, self.staging.changed)
        if report.fallback_params:
            fallback = set(report.fallback_params)
            # vLLM's models define load_weights; nn.Module does not, hence the ignore.
            loaded = set(model.load_weights(self.staging.hf_weights(fallback)))  # type: ignore[operator]
            missed = sorted(fallback - loaded)
            if missed:
                raise RuntimeError(f"version {version}: vLLM's loaders did not load {missed[:5]}")
        return report

    def finish(self) -> None:
        """Staging keeps its bytes until the commit's outcome (`committed`)."""


class InplaceWorker:
    mode = RefitMode.INPLACE

    def __init__(
        self,
        catalog: Catalog,
        member_id: str,
        relay: str,
        token: str,
        hold_limit_s: float,
        in_flight: int,
        keep_delta_base: bool = False,
    ) -> None:
        self.catalog = catalog
        self.endpoint = InplaceEndpoint(member_id, relay, token, hold_limit_s, in_flight)
        self.receiver: InplaceReceiver | None = None  # from the lifecycle's start to its end
        # `--inplace-delta-base`: checkpoint-format copies of the processed layers, by catalog
        # tensor, that deltas apply to (`generator_svc.worker.inplace`); None: no delta refits.
        self.bases: dict[str, torch.Tensor] | None = {} if keep_delta_base else None

    def stage_file(self, path: str, refit_id: str) -> dict[str, int]:
        raise StagingInputError(
            "this generator runs --refit-mode inplace: it has no staging to load a file into"
        )

    def status(self) -> tuple[str | None, list[str]]:
        receiver = self.receiver
        return ("inplace", receiver.missing()[:10]) if receiver else (None, [])

    def drop_staged(self, refit_id: str) -> None:
        """Nothing is staged in this mode."""

    def digest(self, member_id: str) -> WorkerDigest:
        """Unavailable: the bytes were written into the layers and post-processed in place."""
        reason = (
            "--refit-mode inplace keeps no copy in checkpoint format: the layers were "
            "post-processed in place (each was verified where it landed, before that)"
        )
        return WorkerDigest(member_id, version="", available=False, reason=reason)

    def hold(self, refit_id: str) -> None:
        """Generation is held and this worker's install is open (`after_reload` made the
        receiver); the member may receive."""
        if self.receiver is None:
            raise RuntimeError(f"refit {refit_id}: no in-place install is open (start_weight_update first)")
        self.endpoint.held(refit_id, self.receiver)

    def release(self) -> int:
        receiver = self.receiver
        if receiver is None:
            return 0
        receiver.close()
        self.endpoint.released()
        return receiver.changed_layers()

    def recover(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    def committed(self, ok: bool) -> None:
        self.endpoint.released()

    def before_reload(self) -> None:
        """Nothing to check: the bytes arrive after the reload begins."""

    def after_reload(self, model: torch.nn.Module, device: torch.device, vllm_config: Any) -> None:
        self.receiver = InplaceReceiver(model, self.catalog, device, vllm_config, self.bases)

    def install(self, model: torch.nn.Module, version: str) -> WorkerInstall:
        """The receiver installed every layer as it arrived (a full refit: only its completeness
        is checked), or applied a delta that the layers it changed are post-processed from now."""
        if self.receiver is None:
            raise RuntimeError(f"version {version}: no in-place install is open")
        self.receiver.require_complete()
        if self.receiver.is_delta:
            return self.receiver.install_delta()
        return self.receiver.report

    def finish(self) -> None:
        self.receiver = None


def worker_mode(
    mode: RefitMode,
    *,
    catalog: Catalog,
    device: torch.device,
    member_id: str,
    relay: str,
    token: str,
    hold_limit_s: float,
    in_flight: int,
    keep_delta_base: bool = False,
) -> WorkerMode:
    """This worker's object for `mode` (chosen once, at `ws_setup`)."""
    if mode is RefitMode.INPLACE:
        return InplaceWorker(catalog, member_id, relay, token, hold_limit_s, in_flight, keep_delta_base)
    return StagedWorker(catalog, device, member_id, relay, token)
