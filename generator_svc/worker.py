"""The vLLM worker extension (`worker_extension_cls`): mixed into every vLLM worker.

Methods are called from the API-server process with `collective_rpc("ws_...")`, which runs them on
every worker and carries only plain data (no tensors). What runs where:

- API server (generator_svc.refit): the update lifecycle (`pause_generation`, `start_weight_update`,
  `update_weights`, `finish_weight_update`, `reset_prefix_cache`, `resume_generation`), because it
  must be entered by all TP workers together and generation must be held meanwhile.
- worker, via collective_rpc: `ws_setup` (catalog, staging or the inplace receiver's catalog, syncd
  registration), `ws_stage_file`, `ws_status`, `ws_hold` and `ws_release` (inplace), `ws_abort`,
  `ws_recover`, `ws_committed`, `ws_last_install`, `ws_dump_loaded`, `ws_dump_installed` and
  `ws_dump_inplace` (tests).
- worker, on the syncd member's handler thread: the data plane writing received buckets into
  staging (`generator_svc.member`), concurrently with serving: staging is separate memory; or, in
  inplace mode, into the live layers while generation is held (`generator_svc.inplace`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from generator_svc import transfer_engine
from generator_svc.catalog import build_catalog, catalog_to_json
from generator_svc.cpu_moe_fix import apply_cpu_moe_fix
from generator_svc.settings import RefitMode
from generator_svc.staging import StagingInputError
from generator_svc.vllm_layout import allocated_shapes, param_specs
from generator_svc.worker_modes import worker_mode
from generator_svc.worker_status import StatusPublisher, WorkerStatus

log = logging.getLogger("generator_svc.worker")

# Runs at import, i.e. in every worker before its model loads.
transfer_engine.register()
apply_cpu_moe_fix()


class WeightSyncExtension:
    """Weight-sync methods of a vLLM worker. State lives on the worker as `_ws_*` attributes."""

    def _ws_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def _ws_tp(self) -> tuple[int, int]:
        from vllm.distributed import parallel_state

        return (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
        )

    def ws_setup(
        self,
        replica: int,
        syncd: str = "",
        auth_token: str = "",
        internal_url: str = "",
        commit_token: str = "",
        data_host: str = "127.0.0.1",
        in_flight: int = 2,
        status_dir: str = "",
        refit_mode: str = "staged",
        hold_limit_s: float = 300.0,
    ) -> dict[str, Any]:
        """Build this worker's catalog and its refit mode's object (`worker_modes`: staging in
        staged mode); register with syncd when `syncd` is set, and publish this worker's status
        into `status_dir` when set (`worker_status`). Raises ValueError naming any parameter the
        catalog cannot cover."""
        model = self._ws_model()
        tp_rank, tp_size = self._ws_tp()
        shapes = allocated_shapes(model)
        catalog = build_catalog(param_specs(model), expected_shapes=shapes)
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, transfer_engine.StagingTransferEngine):
            raise RuntimeError(f"weight_transfer_config.backend must be {transfer_engine.BACKEND!r}")
        self._ws_catalog = catalog
        self._ws_member_id = f"generator-{replica}-{tp_rank}"
        self._ws_mode = worker_mode(
            RefitMode(refit_mode),
            catalog=catalog,
            device=self.device,  # type: ignore[attr-defined]
            member_id=self._ws_member_id,
            relay=internal_url if tp_rank == 0 else "",
            token=commit_token,
            hold_limit_s=hold_limit_s,
            in_flight=in_flight,
        )
        engine.target = self._ws_mode
        self._ws_member = None
        if syncd:
            from generator_svc.member import start_member

            self._ws_member = start_member(
                syncd,
                member_id=self._ws_member_id,
                coords={"replica": replica, "tp": tp_rank},
                catalog=catalog,
                device=self.device,  # type: ignore[attr-defined]
                endpoint=self._ws_mode.endpoint,
                auth_token=auth_token or None,
                data_host=data_host,
                in_flight=in_flight,
            )
        if status_dir:
            self._ws_status_publisher = StatusPublisher(
                status_dir, self._ws_member_id, self._ws_worker_status
            )
        log.info(
            "%s: catalog %s, %d tensors, %d bytes",
            self._ws_member_id,
            catalog.content_hash[:19],
            len(catalog.tensors),
            catalog.nbytes,
        )
        return {
            "member_id": self._ws_member_id,
            "pid": os.getpid(),
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "catalog_hash": catalog.content_hash,
            "nbytes": catalog.nbytes,
            "shapes_checked": sum(t.name in shapes for t in catalog.tensors),
        }

    def _ws_worker_status(self) -> WorkerStatus:
        # The member's client knows the version of this worker's last confirmed Commit (None after
        # a start: the --model checkpoint is no trainer version) and syncd's committed version.
        client = self._ws_member.client if self._ws_member is not None else None
        return WorkerStatus(
            member_id=self._ws_member_id,
            pid=os.getpid(),
            unregistered=client is not None and not client.wait_registered(0),
            serves=client.weight_version if client else None,
            committed=client.committed_version if client else None,
            committing=tuple(sorted(client.committing_versions)) if client else (),
            written_at=time.time(),
        )

    def ws_catalog(self) -> str:
        return catalog_to_json(self._ws_catalog)

    def ws_param_names(self) -> list[str]:
        return [n for n, _ in self._ws_model().named_parameters()]

    def ws_stage_file(self, path: str, refit_id: str) -> dict[str, Any]:
        """Stage this worker's boxes of a safetensors checkpoint (the data plane's stand-in for
        operators and tests). Starts refit `refit_id`: earlier staged bytes no longer count.
        Returns {"tensors", "skipped"}, or {"rejected": why} when the input is not a checkpoint
        of this catalog (exceptions cross collective_rpc as text, so the API server could not
        tell bad input from a bug)."""
        try:
            return self._ws_mode.stage_file(path, refit_id)
        except StagingInputError as e:
            return {"rejected": f"{self._ws_member_id}: {e}"}

    def ws_status(self) -> dict[str, Any]:
        """What is ready to commit: staging (staged) or the open in-place install (inplace)."""
        refit_id, missing = self._ws_mode.status()
        return {"member_id": self._ws_member_id, "refit_id": refit_id, "missing": missing}

    def ws_hold(self, refit_id: str) -> None:
        """inplace: generation is held and this worker's install is open (start_weight_update made
        the receiver); the member may receive."""
        self._ws_mode.hold(refit_id)

    def ws_release(self) -> int:
        """inplace: close the open install (it takes no more bytes); returns how many layers it had
        installed (0: the engine still holds the committed version whole). `ws_recover` follows."""
        return self._ws_mode.release()

    def ws_abort(self, refit_id: str = "") -> None:
        """Drop staged bytes of `refit_id` (any when empty); serving is unaffected."""
        self._ws_mode.drop_staged(refit_id)

    def ws_recover(self) -> None:
        """After an update failed inside the lifecycle: put every layer back on real tensors
        (layers not yet loaded get their previous kernel tensors back) so the next forward cannot
        meet meta parameters. The engine must not serve until a complete refit succeeds."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._ws_mode.recover()
        self.weight_transfer_engine.reset_weight_update_target()  # type: ignore[attr-defined]
        self._weight_update_active = False
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            finalize_layerwise_reload(self._ws_model(), self.model_config)  # type: ignore[attr-defined]

    def ws_committed(self, refit_id: str, version: str, ok: bool, error: str = "") -> None:
        """Tell syncd this worker's outcome of a Commit (the API server applied it)."""
        if self._ws_member is not None and refit_id:
            self._ws_mode.endpoint.applied(version, ok, error)
        self._ws_mode.committed(ok)

    def ws_last_install(self) -> dict[str, Any]:
        """What the last install did on this worker (`InstallReport`), {} before the first."""
        report = self.weight_transfer_engine.last_install  # type: ignore[attr-defined]
        return report.as_dict() if report is not None else {}

    def ws_dump_loaded(self, checkpoint: str, out_dir: str) -> str:
        """Test aid: reload `checkpoint` through vLLM's own loader inside the layerwise reload and
        save every parameter as vLLM's loaders wrote it (checkpoint format, before kernel
        processing) to `{out_dir}/tp{rank}.safetensors`. The engine serves `checkpoint` afterwards."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self._ws_model()

        def load() -> None:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                initialize_layerwise_reload(model)
                try:
                    model.load_weights(_read_checkpoint(checkpoint))
                finally:
                    finalize_layerwise_reload(model, self.model_config)  # type: ignore[attr-defined]

        return self._ws_dump(load, f"{out_dir}/tp{self._ws_tp()[0]}.safetensors")

    def ws_dump_installed(self, checkpoint: str, out_dir: str) -> str:
        """Test aid: like `ws_dump_loaded`, but through the staged refit path (stage `checkpoint`,
        then the update lifecycle with the install by parameter), to
        `{out_dir}/installed-tp{rank}.safetensors`."""

        def install() -> None:
            staging = self._ws_mode.staging  # type: ignore[attr-defined]  # a staged worker's
            staging.begin("dump")
            staging.fill_from_safetensors(checkpoint)
            self.start_weight_update()  # type: ignore[attr-defined]
            self.update_weights({"version": "dump"})  # type: ignore[attr-defined]
            self.finish_weight_update()  # type: ignore[attr-defined]
            staging.discard()

        return self._ws_dump(install, f"{out_dir}/installed-tp{self._ws_tp()[0]}.safetensors")

    def ws_dump_inplace(self, checkpoint: str, out_dir: str, bucket_bytes: int = 1 << 16) -> dict[str, Any]:
        """Test aid: like `ws_dump_installed`, through the in-place install: `checkpoint` packed into
        buckets of `bucket_bytes` as a one-rank trainer would send them (`inplace.checkpoint_buckets`),
        each handed to an `InplaceReceiver` inside the layerwise reload. Saves
        `{out_dir}/inplace-tp{rank}.safetensors`; returns the receiver's report."""
        from generator_svc.inplace import checkpoint_buckets, install_buckets

        packed = checkpoint_buckets(self._ws_catalog, self._ws_member_id, checkpoint, bucket_bytes)
        out: dict[str, Any] = {}

        def install() -> None:
            receiver = install_buckets(
                self._ws_model(),
                self._ws_catalog,
                self.device,  # type: ignore[attr-defined]
                self.vllm_config,
                packed,
            )  # type: ignore[attr-defined]
            out.update(receiver.report.as_dict())

        self._ws_dump(install, f"{out_dir}/inplace-tp{self._ws_tp()[0]}.safetensors")
        return out

    def _ws_dump(self, run, out_path: str) -> str:
        """Run `run` and save every parameter in checkpoint format: the values each layer's
        `process_weights_after_loading` received (before kernel repacking), and the parameters of
        layers that have no processing as they are afterwards."""
        from safetensors.torch import save_file
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        model = self._ws_model()
        captured: dict[str, torch.Tensor] = {}
        restore = []
        for path, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, QuantizeMethodBase):
                original = method.process_weights_after_loading

                def capture(layer, _path=path, _orig=original):
                    for n, p in layer.named_parameters(recurse=False):
                        captured[f"{_path}.{n}"] = p.detach().clone()
                    return _orig(layer)

                method.process_weights_after_loading = capture
                restore.append(method)
        try:
            run()
        finally:
            for method in restore:
                del method.process_weights_after_loading
        for n, p in model.named_parameters():
            captured.setdefault(n, p.detach().clone())
        save_file({k: v.contiguous() for k, v in captured.items()}, out_path)
        return out_path


def _read_checkpoint(directory: str):
    from pathlib import Path

    from safetensors import safe_open

    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                yield name, f.get_tensor(name)
