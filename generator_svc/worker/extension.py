"""The vLLM worker extension (`worker_extension_cls`): mixed into every vLLM worker.

Methods are called from the API-server process with `collective_rpc("ws_...")`, which runs them on
every worker and carries only plain data (no tensors): the messages of
`generator_svc.worker_protocol`, in their wire form. What runs where:

- API server (generator_svc.server.refit): the update lifecycle (`pause_generation`, `start_weight_update`,
  `update_weights`, `finish_weight_update`, `reset_prefix_cache`, `resume_generation`), because it
  must be entered by all TP workers together and generation must be held meanwhile.
- worker, via collective_rpc: `ws_setup` (catalog, this worker's refit mode object from
  `generator_svc.worker.worker_modes`, syncd registration), `ws_stage_file`, `ws_status`, `ws_hold` and
  `ws_release` (inplace), `ws_abort`, `ws_recover`, `ws_committed`, `ws_last_install`, which hand
  whatever depends on the refit mode to that object; with LoRA on, `ws_install_adapter` (at an
  adapter refit's commit, into its slot) and `ws_adapter_digest` (`adapter_endpoint`). (Test aids
  that run in the worker live in `tests/generator/worker_aids.py`.)
- worker, on the syncd member's handler thread: the data plane writing received buckets into
  staging (`generator_svc.worker.syncd_member`), concurrently with serving: staging is separate memory; or, in
  inplace mode, into the live layers while generation is held (`generator_svc.worker.inplace`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from multiprocessing import util as mp_util
from typing import TYPE_CHECKING, Any

import torch

from generator_svc.settings import TRANSFER_BACKEND
from generator_svc.vllm_adapter import (
    abandon_weight_update,
    apply_cpu_moe_fix,
    lora_dtype,
    lora_model_manager,
    lora_slot_limits,
    request_cpu_amx_tiles,
    tensor_parallel_position,
    worker_model,
)
from generator_svc.worker import lora_slots, transfer_engine
from generator_svc.worker.adapter_endpoint import SlotsEndpoint
from generator_svc.worker.catalog import build_catalog, catalog_to_json
from generator_svc.worker.staging import StagingInputError
from generator_svc.worker.status_publisher import StatusPublisher
from generator_svc.worker.vllm_layout import allocated_shapes, param_specs
from generator_svc.worker.worker_modes import worker_mode
from generator_svc.worker_protocol import (
    CommitOutcome,
    CommitReadiness,
    StagedFile,
    WorkerInfo,
    WorkerSetup,
    WorkerStatus,
)
from syncd.layout.adapters import LoraSlots

log = logging.getLogger("generator_svc.worker")
# multiprocessing runs finalizers of higher exit priority first: leaving syncd comes early, while
# the rest of the process is still whole.
_LEAVE_AT_EXIT = 10

# Runs at import, i.e. in every worker before its model loads.
transfer_engine.register()
apply_cpu_moe_fix()
request_cpu_amx_tiles()


class WeightSyncExtension:
    """Weight-sync methods of a vLLM worker. State lives on the worker as `_ws_*` attributes."""

    if TYPE_CHECKING:  # what the vLLM worker this class extends (`worker_extension_cls`) provides
        # (vLLM's own types stay behind generator_svc.vllm_adapter: VllmConfig, ModelConfig.)
        model_runner: Any
        device: torch.device
        vllm_config: Any
        model_config: Any
        # vLLM's is `WeightTransferEngine | None`; `ws_setup` refuses any other than ours.
        weight_transfer_engine: transfer_engine.StagingTransferEngine

        def start_weight_update(self) -> None: ...
        def update_weights(self, update_info: dict | list[dict]) -> None: ...
        def finish_weight_update(self) -> None: ...

    def _ws_model(self) -> torch.nn.Module:
        return worker_model(self)

    def _ws_tp(self) -> tuple[int, int]:
        return tensor_parallel_position()

    def ws_setup(self, setup: WorkerSetup | Mapping[str, Any]) -> dict[str, Any]:
        """Build this worker's catalog and its refit mode's object (`worker_modes`: staging in
        staged mode); register with syncd when `setup.syncd` is set, and publish this worker's
        status into `setup.status_dir` when set (`status_publisher`). Returns a `WorkerInfo`'s
        wire form (`generator_svc.worker_protocol`). Raises ValueError naming any parameter the
        catalog cannot cover, RuntimeError when this worker is a syncd member already (an engine
        attached twice)."""
        setup = WorkerSetup.from_wire(setup)
        if (member := getattr(self, "_ws_member", None)) is not None:
            raise RuntimeError(
                f"this worker is already syncd member {member.client.member_id} (ws_close first)"
            )
        model = self._ws_model()
        tp_rank, tp_size = self._ws_tp()
        shapes = allocated_shapes(model)
        catalog = build_catalog(param_specs(model), expected_shapes=shapes)
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, transfer_engine.StagingTransferEngine):
            raise RuntimeError(f"weight_transfer_config.backend must be {TRANSFER_BACKEND!r}")
        self._ws_catalog = catalog
        self._ws_member_id = f"generator-{setup.replica}-{tp_rank}"
        self._ws_mode = worker_mode(
            setup.refit_mode,
            catalog=catalog,
            device=self.device,
            member_id=self._ws_member_id,
            relay=setup.internal_url if tp_rank == 0 else "",
            token=setup.commit_token,
            hold_limit_s=setup.hold_limit_s,
            in_flight=setup.in_flight,
            keep_delta_base=setup.keep_delta_base,
        )
        engine.target = self._ws_mode
        self._ws_member = None
        slots, self._ws_slots = self._ws_adapter_slots(tp_size, setup)
        if setup.syncd:
            from generator_svc.worker.syncd_member import start_member

            self._ws_member = start_member(
                setup.syncd,
                member_id=self._ws_member_id,
                coords={"replica": setup.replica, "tp": tp_rank},
                catalog=catalog,
                device=self.device,
                endpoint=self._ws_slots or self._ws_mode.endpoint,
                auth_token=setup.auth_token or None,
                data_host=setup.data_host,
                in_flight=setup.in_flight,
                lora_slots=slots,
            )
            # A worker that vLLM stops gracefully (a signal to the whole process group, a drain)
            # leaves syncd on its way out (`generator_svc.server.leave_on_shutdown` covers the rest).
            # vLLM's workers are multiprocessing children: they run multiprocessing's finalizers,
            # not `atexit`, as they exit. `ws_close` is idempotent.
            mp_util.Finalize(None, self.ws_close, exitpriority=_LEAVE_AT_EXIT)
        if setup.status_dir:
            self._ws_status_publisher = StatusPublisher(
                setup.status_dir, self._ws_member_id, self._ws_worker_status
            )
        log.info(
            "%s: catalog %s, %d tensors, %d bytes",
            self._ws_member_id,
            catalog.content_hash[:19],
            len(catalog.tensors),
            catalog.nbytes,
        )
        return WorkerInfo(
            member_id=self._ws_member_id,
            pid=os.getpid(),
            tp_rank=tp_rank,
            tp_size=tp_size,
            catalog_hash=catalog.content_hash,
            nbytes=catalog.nbytes,
            shapes_checked=sum(t.name in shapes for t in catalog.tensors),
        ).to_wire()

    def _ws_adapter_slots(
        self, tp_size: int, setup: WorkerSetup
    ) -> tuple[LoraSlots | None, SlotsEndpoint | None]:
        """With LoRA on, this worker takes named adapters into slots (`adapter_endpoint`): what it
        registers with syncd, and the endpoint that receives them. Slots hold whole factors, so
        only at tensor-parallel size 1."""
        if lora_model_manager(self) is None:
            return None, None
        if tp_size != 1:
            log.warning(
                "%s: LoRA is on at tp %d; adapter slots need tp 1, so syncd sends none",
                self._ws_member_id,
                tp_size,
            )
            return None, None
        max_rank, max_loras, _ = lora_slot_limits(self)
        dtype = lora_dtype(self)
        slots = LoraSlots(max_rank, max_loras, str(dtype).removeprefix("torch."))
        endpoint = SlotsEndpoint(
            self._ws_mode.endpoint, self._ws_member_id, setup.internal_url, setup.commit_token, dtype
        )
        return slots, endpoint

    def ws_install_adapter(self, refit_id: str, adapter_id: int) -> dict[str, Any]:
        """On the engine's thread: write the verified adapter of refit `refit_id` into its slot,
        as vLLM's LoRA id `adapter_id` (`lora_slots.install`). Returns its name, slot and whether
        it was added (first install) or rewritten."""
        if self._ws_slots is None:
            raise RuntimeError(f"{self._ws_member_id} takes no adapters into slots")
        staged = self._ws_slots.take(refit_id)
        spec = staged.spec
        _, _, max_positions = lora_slot_limits(self)
        result = lora_slots.install(
            self,
            adapter_id,
            staged.factors,
            lora_slots.AdapterSpec(spec.rank, spec.alpha, spec.target_modules, max_positions),
        )
        return {"adapter": spec.name, "slot": result.slot, "added": result.added}

    def ws_adapter_digest(self, adapter_id: int) -> str:
        """What adapter `adapter_id`'s slot holds, as a digest (`lora_slots.slot_digest`)."""
        return lora_slots.slot_digest(self, adapter_id)

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
        Returns a `StagedFile`'s wire form, `rejected` saying why when the input is not a
        checkpoint of this catalog."""
        try:
            counts = self._ws_mode.stage_file(path, refit_id)
        except StagingInputError as e:
            return StagedFile(self._ws_member_id, rejected=f"{self._ws_member_id}: {e}").to_wire()
        return StagedFile(self._ws_member_id, tensors=counts["tensors"], skipped=counts["skipped"]).to_wire()

    def ws_status(self) -> dict[str, Any]:
        """What is ready to commit (a `CommitReadiness`'s wire form): staging (staged) or the open
        in-place install (inplace)."""
        refit_id, missing = self._ws_mode.status()
        return CommitReadiness(self._ws_member_id, refit_id, tuple(missing)).to_wire()

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
        self._ws_mode.recover()
        abandon_weight_update(self)

    def ws_committed(self, outcome: CommitOutcome | Mapping[str, Any]) -> None:
        """Tell syncd this worker's outcome of a Commit (the API server applied it)."""
        outcome = CommitOutcome.from_wire(outcome)
        if self._ws_member is not None and outcome.refit_id:
            self._ws_mode.endpoint.applied(outcome.version, outcome.ok, outcome.error)
        self._ws_mode.committed(outcome.ok)

    def ws_digest(self) -> dict[str, Any]:
        """This worker's digest of the version it serves (a `WorkerDigest`'s wire form,
        `generator_svc.worker.digest`)."""
        return self._ws_mode.digest(self._ws_member_id).to_wire()

    def ws_close(self) -> None:
        """Leave syncd and stop publishing this worker's status (an attached engine detached,
        `generator_svc.attach`); the engine keeps serving the weights it holds."""
        if self._ws_member is not None:
            self._ws_member.close()
            self._ws_member = None
        publisher = getattr(self, "_ws_status_publisher", None)
        if publisher is not None:
            publisher.stop()

    def ws_last_install(self) -> dict[str, Any] | None:
        """What the last install did on this worker (a `WorkerInstall`'s wire form), None before
        the first."""
        report = self.weight_transfer_engine.last_install
        return report.to_wire() if report is not None else None
