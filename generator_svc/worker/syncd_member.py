"""The syncd member of one vLLM worker: the shared `MemberAgent` with this worker's endpoint, one
per refit mode. Runs inside the worker process, on the MemberClient's threads.

                staged (`StagedEndpoint`)                inplace (`InplaceEndpoint`)
    ExecutePlan receive into the staging buffers while   tp rank 0 asks the API server to hold
                serving goes on; every unit is recorded  generation and open the install on every
                                                         worker (`/internal/hold`), then receive
                                                         into the live layers (`InplaceReceiver`)
    Verify      every staged element arrived             every layer arrived and was post-processed
    Commit      tp rank 0 asks the API server to apply (`/internal/commit`, authenticated with the
                worker token, bounded by syncd's `timeout_s`); the API server runs (staged) or ends
                (inplace) the update lifecycle on all workers and tells each worker the outcome
                (`applied`); every worker then reports COMMITTED or the error, or, when the deadline
                passes first, the timeout (the version never goes live)
    Abort       the agent cancels the transfer and       the receiver takes no more bytes; tp rank 0
                closes the groups; staging is dropped,   releases the hold (`/internal/release`):
                the engine keeps serving the committed   the engine serves on if nothing was
                version                                  installed yet (or a delta was rolled
                                                         back), else answers 503 until a
                                                         complete refit
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import httpx
import torch

from generator_svc.worker.digest import ServedRegions
from generator_svc.worker.inplace import InplaceReceiver
from generator_svc.worker.staging import Staging, planned_tensors
from syncd import http_client
from syncd.layout import Catalog
from syncd.layout.adapters import LoraSlots
from syncd.member import join
from syncd.member.agent import Endpoint, MemberAgent
from syncd.member.client import MemberClient
from syncd.plan.types import Bucket
from syncd.vocabulary import Role
from syncd.weight_version import WeightVersion, version_label

log = logging.getLogger("generator_svc.worker.syncd_member")


def _answer_margin_s(timeout_s: float) -> float:
    """Time kept back from the API server's install budget for its answer to reach the workers."""
    return min(2.0, 0.1 * timeout_s)


class _CommitRelay:
    """Commit for both modes: tp rank 0 relays syncd's Commit to the API server; every worker waits
    for the API server's word on the outcome (`applied`)."""

    def __init__(self, member_id: str, internal_url: str, token: str = "") -> None:
        self.member_id, self.internal_url, self.token = member_id, internal_url, token
        self._outcomes: dict[str, tuple[bool, str]] = {}  # version label -> (ok, error) of its apply
        self._applied = threading.Condition()

    def _post(self, route: str, body: dict, timeout_s: float) -> httpx.Response:
        return http_client.post(
            f"{self.internal_url}/{route}",
            timeout=timeout_s,
            json=body,
            headers={"Authorization": f"Bearer {self.token}"},
        )

    def commit(self, refit_id: str, weight_version: WeightVersion, timeout_s: float) -> None:
        """Return once this worker runs `weight_version`; raise if applying it failed or did not
        finish within `timeout_s` (syncd's commit deadline). The API server gets the deadline less
        `_answer_margin_s`, so its outcome (live or not) is decided before this wait gives up and
        a version reported failed is never made live."""
        version = version_label(weight_version)  # what the API server applies and reports
        deadline = time.monotonic() + timeout_s
        if self.internal_url:
            budget = timeout_s - _answer_margin_s(timeout_s)
            if budget <= 0:
                raise TimeoutError(f"version {version}: {timeout_s:.1f} s left is too little to install")
            response = self._post(
                "commit", {"refit_id": refit_id, "version": weight_version, "timeout_s": budget}, timeout_s
            )
            if response.status_code >= 400:
                raise RuntimeError(
                    f"apply of version {version} failed ({response.status_code}): {response.text}"
                )
        with self._applied:
            if not self._applied.wait_for(
                lambda: version in self._outcomes, max(deadline - time.monotonic(), 0)
            ):
                raise TimeoutError(f"version {version} was not applied within {timeout_s:.1f} s")
            ok, error = self._outcomes.pop(version)
        if not ok:
            raise RuntimeError(f"apply of version {version} failed: {error}")

    def applied(self, version: str, ok: bool, error: str = "") -> None:
        """The API server's word on the apply of the version labelled `version` (via collective_rpc)."""
        with self._applied:
            self._outcomes[version] = (ok, error)
            self._applied.notify_all()


class GeneratorEndpoint(Endpoint, Protocol):
    """The member agent's endpoint of one refit mode, plus what the API server tells it."""

    # The planner cuts this member's buckets at groups of whole layers (an in-place install
    # post-processes whole layers, so it asks for that).
    receive_by_layer: bool

    def applied(self, version: str, ok: bool, error: str = "") -> None: ...


class StagedEndpoint(_CommitRelay):
    """`staged` mode: receive into staging while serving goes on; the commit installs it."""

    receive_by_layer = False

    def __init__(self, staging: Staging, member_id: str, internal_url: str, token: str = "") -> None:
        super().__init__(member_id, internal_url, token)
        self.staging = staging
        self.served = ServedRegions()  # what staging holds of the served version (`digest`)
        self._buckets: tuple[Bucket, ...] = ()

    def begin(
        self, refit_id: str, weight_version: WeightVersion, buckets: Sequence[Bucket]
    ) -> Mapping[str, torch.Tensor]:
        self.staging.begin(refit_id, planned_tensors(buckets, self.member_id))
        self.served.receiving(refit_id, buckets, self.member_id)
        self._buckets = tuple(buckets)
        return self.staging.buffers

    def applied(self, version: str, ok: bool, error: str = "") -> None:
        if ok:
            self.served.applied(version)
        super().applied(version, ok, error)

    def end(self, refit_id: str, ok: bool) -> None:
        if ok:
            self.staging.mark_received(self._buckets, self.member_id)

    def received_delta(self, refit_id: str, changed: frozenset[str]) -> None:
        """A delta applied onto the committed version staging held: the install copies and
        post-processes only the layers of `changed`."""
        self.staging.changed = changed

    def verify(self, refit_id: str) -> None:
        self.staging.require_complete()

    def abort(self) -> None:
        self.staging.discard()


class InplaceEndpoint(_CommitRelay):
    """`inplace` mode (`generator_svc.worker.inplace`): before receiving, tp rank 0 asks the API server to
    hold generation and open the install on every worker (`/internal/hold`); each worker receives
    into its `InplaceReceiver`; Abort releases the hold (`/internal/release`: 503 until a complete
    refit when layers were already installed)."""

    receive_by_layer = True

    def __init__(
        self, member_id: str, internal_url: str, token: str, hold_limit_s: float, in_flight: int
    ) -> None:
        super().__init__(member_id, internal_url, token)
        self.hold_limit_s, self.in_flight = hold_limit_s, in_flight
        self._held = threading.Condition()
        self._receiver: tuple[str, InplaceReceiver] | None = None  # (refit id, receiver) once held
        self._refit_id = ""
        self._aborted = False

    def begin(
        self, refit_id: str, weight_version: WeightVersion, buckets: Sequence[Bucket]
    ) -> InplaceReceiver:
        with self._held:
            self._refit_id, self._aborted = refit_id, False
        if self.internal_url:
            response = self._post(
                "hold", {"refit_id": refit_id, "version": weight_version}, self.hold_limit_s
            )
            if response.status_code >= 400:
                raise RuntimeError(
                    f"holding generation for refit {refit_id} failed ({response.status_code}): "
                    f"{response.text}"
                )
        with self._held:
            if not self._held.wait_for(
                lambda: self._aborted or (self._receiver or ("",))[0] == refit_id, self.hold_limit_s
            ):
                raise TimeoutError(
                    f"refit {refit_id}: generation was not held within {self.hold_limit_s:.0f} s"
                )
            if self._aborted:
                raise RuntimeError(f"refit {refit_id} was aborted before its transfer began")
            assert self._receiver is not None  # the wait ended on our receiver (or raised)
            receiver = self._receiver[1]
        receiver.receive_buffers(
            max((b.nbytes for b in buckets if b.dst == self.member_id), default=0), self.in_flight
        )
        receiver.transfer_started()
        return receiver

    def held(self, refit_id: str, receiver: InplaceReceiver) -> None:
        """The API server holds generation and this worker's install is open (`ws_hold`)."""
        with self._held:
            self._receiver = (refit_id, receiver)
            self._held.notify_all()

    def released(self) -> None:
        """The install was closed (committed, or released by the API server)."""
        with self._held:
            self._receiver = None

    def end(self, refit_id: str, ok: bool) -> None:
        """The receiver counted every arrived element; a delta that failed is rolled back now."""
        with self._held:
            held = self._receiver
        if held is not None and held[0] == refit_id:
            held[1].transfer_ended(ok)

    def received_delta(self, refit_id: str, changed: frozenset[str]) -> None:
        """A delta was applied in place: the commit post-processes only the layers of `changed`."""
        with self._held:
            held = self._receiver
        if held is not None and held[0] == refit_id:
            held[1].touch(changed)

    def verify(self, refit_id: str) -> None:
        with self._held:
            held = self._receiver
        if held is None or held[0] != refit_id:
            raise RuntimeError(f"refit {refit_id}: no in-place install is open on {self.member_id}")
        held[1].require_complete()

    def abort(self) -> None:
        with self._held:
            refit_id, held = self._refit_id, self._receiver
            self._aborted = True
            self._held.notify_all()
        if held is not None:
            held[1].close()  # no more bytes into the engine from this refit
        if self.internal_url and refit_id:
            response = self._post("release", {"refit_id": refit_id}, self.hold_limit_s)
            if response.status_code >= 400:
                log.warning(
                    "%s: releasing refit %s: %s %s",
                    self.member_id,
                    refit_id,
                    response.status_code,
                    response.text,
                )


class GeneratorMember:
    """Registration plus the agent; `close` leaves syncd and tears the groups down."""

    def __init__(self, client: MemberClient, endpoint: GeneratorEndpoint, agent: MemberAgent) -> None:
        self.client, self.endpoint, self.agent = client, endpoint, agent

    def close(self) -> None:
        self.agent.close()
        self.client.close()


def start_member(
    target: str,
    *,
    member_id: str,
    coords: dict[str, int],
    catalog: Catalog,
    device: torch.device,
    endpoint: GeneratorEndpoint,
    auth_token: str | None,
    data_host: str = "127.0.0.1",
    in_flight: int = 2,
    lora_slots: LoraSlots | None = None,
) -> GeneratorMember:
    member = join(
        target,
        endpoint,
        role=Role.GENERATOR,
        member_id=member_id,
        coords=coords,
        catalog=catalog,
        device=str(device),
        data_host=data_host,
        auth_token=auth_token,
        # The engine starts on its --model checkpoint, which is no trainer version:
        # it registers serving none, so syncd holds it not ready and catches it up.
        weight_version=None,
        receive_by_layer=endpoint.receive_by_layer,
        in_flight=in_flight,
        lora_slots=lora_slots,
    )
    return GeneratorMember(member.client, endpoint, member.agent)
