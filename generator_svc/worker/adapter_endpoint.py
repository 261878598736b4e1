"""The syncd endpoint of a worker whose engine takes named LoRA adapters into slots: the refit
mode's endpoint for the base weights, plus refits of adapters (`syncd.layout.adapters`).

Lifecycle of an adapter refit, beside the base's (which this endpoint hands to the mode's):

    ExecutePlan  `begin_adapter`: a small staging of the adapter's factors (their shapes and dtype
                 from the plan's units, which cover each slot tensor whole); the data plane
                 writes into it and checks each unit where it landed, as for the base weights
    Verify       every planned factor arrived
    Commit       tp rank 0 asks the API server to install it (`/internal/adapters/commit`, with
                 the worker token, within syncd's deadline); the API server calls `ws_install_adapter`
                 on the engine's thread, which takes the staging (`take`) and writes it into the
                 adapter's slot (`generator_svc.worker.lora_slots`), then serves the adapter under
                 its name at its new version. The base weights are never touched.
    Abort        the staging is dropped; the slot keeps the committed version

Slots hold whole factors, so only engines at tensor-parallel size 1 offer them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from generator_svc.worker.syncd_member import GeneratorEndpoint
from syncd import http_client
from syncd.layout.adapters import AdapterSpec, parse_slot_tensor
from syncd.member.dataplane.prepared import ReceiveSink
from syncd.plan.types import Bucket
from syncd.weight_version import WeightVersion


@dataclass
class StagedAdapter:
    """An adapter refit's factors as they arrive: by canonical (PEFT) name."""

    refit_id: str
    spec: AdapterSpec
    version: WeightVersion
    factors: dict[str, torch.Tensor]
    received: bool = False


class SlotsEndpoint:
    """`GeneratorEndpoint` of the refit mode, plus `begin_adapter` for refits of named adapters."""

    def __init__(
        self, base: GeneratorEndpoint, member_id: str, internal_url: str, token: str, dtype: torch.dtype
    ) -> None:
        self.base, self.member_id, self.internal_url, self.token = base, member_id, internal_url, token
        self.dtype = dtype  # what the slots hold
        self.receive_by_layer = base.receive_by_layer
        self._lock = threading.Lock()
        self._adapter: StagedAdapter | None = None  # the adapter refit in progress, if any

    # ---- the base weights: the refit mode's endpoint ----

    def begin(
        self, refit_id: str, weight_version: WeightVersion, buckets: Sequence[Bucket]
    ) -> Mapping[str, torch.Tensor] | ReceiveSink:
        with self._lock:
            self._adapter = None
        return self.base.begin(refit_id, weight_version, buckets)

    def applied(self, version: str, ok: bool, error: str = "") -> None:
        self.base.applied(version, ok, error)

    def received_delta(self, refit_id: str, changed: frozenset[str]) -> None:
        self.base.received_delta(refit_id, changed)  # type: ignore[attr-defined]  # both modes have it

    # ---- adapters ----

    def begin_adapter(
        self, refit_id: str, weight_version: WeightVersion, buckets: Sequence[Bucket], spec: AdapterSpec
    ) -> dict[str, torch.Tensor]:
        """Staging for adapter `spec`'s factors, by slot tensor name (what the plan writes)."""
        shapes: dict[str, list[int]] = {}
        for b in buckets:
            if b.dst != self.member_id:
                continue
            for u in b.units:
                adapter, _ = parse_slot_tensor(u.dst_tensor)
                if adapter != spec.name:
                    raise ValueError(f"refit {refit_id} of adapter {spec.name!r} writes {u.dst_tensor}")
                shape = shapes.setdefault(u.dst_tensor, [0] * len(u.dst_box.stop))
                shapes[u.dst_tensor] = [max(a, b) for a, b in zip(shape, u.dst_box.stop)]
        buffers = {n: torch.zeros(s, dtype=self.dtype) for n, s in shapes.items()}
        factors = {parse_slot_tensor(n)[1]: t for n, t in buffers.items()}
        with self._lock:
            self._adapter = StagedAdapter(refit_id, spec, weight_version, factors)
        return buffers

    def take(self, refit_id: str) -> StagedAdapter:
        """The verified factors of adapter refit `refit_id`, for its install (once)."""
        with self._lock:
            staged, self._adapter = self._adapter, None
        if staged is None or staged.refit_id != refit_id or not staged.received:
            raise RuntimeError(f"{self.member_id}: no verified adapter of refit {refit_id} is staged")
        return staged

    def _staged(self, refit_id: str) -> StagedAdapter | None:
        with self._lock:
            staged = self._adapter
        return staged if staged is not None and staged.refit_id == refit_id else None

    # ---- both: by the refit ----

    def end(self, refit_id: str, ok: bool) -> None:
        staged = self._staged(refit_id)
        if staged is None:
            self.base.end(refit_id, ok)
        else:
            staged.received = ok

    def verify(self, refit_id: str) -> None:
        staged = self._staged(refit_id)
        if staged is None:
            self.base.verify(refit_id)
        elif not staged.received:
            raise RuntimeError(f"{self.member_id}: adapter {staged.spec.name!r} did not arrive whole")

    def commit(self, refit_id: str, weight_version: WeightVersion, timeout_s: float) -> None:
        staged = self._staged(refit_id)
        if staged is None:
            self.base.commit(refit_id, weight_version, timeout_s)
            return
        if not self.internal_url:
            raise RuntimeError("adapter slots are installed through generator_svc's API server; none is set")
        response = http_client.post(
            f"{self.internal_url}/adapters/commit",
            timeout=timeout_s,
            json={
                "refit_id": refit_id,
                "adapter": staged.spec.name,
                "version": weight_version,
                "timeout_s": max(timeout_s - min(2.0, 0.1 * timeout_s), 0.0),
            },
            headers={"Authorization": f"Bearer {self.token}"},
        )
        if response.status_code >= 400:
            raise RuntimeError(
                f"install of adapter {staged.spec.name!r} version {weight_version} failed "
                f"({response.status_code}): {response.text}"
            )

    def abort(self) -> None:
        with self._lock:
            staged, self._adapter = self._adapter, None
        if staged is None:
            self.base.abort()
