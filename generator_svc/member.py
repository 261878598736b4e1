"""The syncd member of one vLLM worker: the shared `MemberAgent` with this worker's staging area
as its endpoint. Runs inside the worker process, on the MemberClient's threads.

    ExecutePlan -> receive this member's buckets straight into the staging buffers (serving goes
                   on: staging is not the live weights); every arrived unit is recorded
    Verify      -> every staged element arrived
    Commit      -> tp rank 0 asks the API server to apply (`commit_url`, authenticated with the
                   worker token, bounded by syncd's `timeout_s`); the API server runs the update
                   lifecycle on all workers and tells each worker the outcome
                   (`GeneratorEndpoint.applied`); every worker then reports COMMITTED or the error,
                   or, when the deadline passes first, the timeout (the version never goes live)
    Abort       -> the agent cancels the transfer and closes the groups; staging is dropped, the
                   engine keeps serving the committed version
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Mapping, Sequence

import httpx
import torch

from generator_svc.staging import Staging
from syncd.agent import AgentSettings, MemberAgent
from syncd.client import MemberClient
from syncd.plan.types import Bucket

log = logging.getLogger("generator_svc.member")


def _answer_margin_s(timeout_s: float) -> float:
    """Time kept back from the API server's install budget for its answer to reach the workers."""
    return min(2.0, 0.1 * timeout_s)


class GeneratorEndpoint:
    def __init__(self, staging: Staging, member_id: str, commit_url: str, commit_token: str = "") -> None:
        self.staging, self.member_id, self.commit_url = staging, member_id, commit_url
        self.commit_token = commit_token
        self._buckets: tuple[Bucket, ...] = ()
        self._outcomes: dict[str, tuple[bool, str]] = {}  # version -> (ok, error) of its apply
        self._applied = threading.Condition()

    def begin(self, refit_id: str, weight_version: int, buckets: Sequence[Bucket]) -> Mapping[str, torch.Tensor]:
        self.staging.begin(refit_id)
        self._buckets = tuple(buckets)
        return self.staging.buffers

    def end(self, refit_id: str, ok: bool) -> None:
        if ok:
            self.staging.mark_received(self._buckets, self.member_id)

    def verify(self, refit_id: str) -> None:
        self.staging.require_complete()

    def commit(self, refit_id: str, weight_version: int, timeout_s: float) -> None:
        """Return once this worker runs `weight_version`; raise if applying it failed or did not
        finish within `timeout_s` (syncd's commit deadline). The API server gets the deadline less
        `_answer_margin_s`, so its outcome (live or not) is decided before this wait gives up and
        a version reported failed is never made live."""
        version = str(weight_version)
        deadline = time.monotonic() + timeout_s
        if self.commit_url:
            budget = timeout_s - _answer_margin_s(timeout_s)
            if budget <= 0:
                raise TimeoutError(f"version {version}: {timeout_s:.1f} s left is too little to install")
            response = httpx.post(self.commit_url, timeout=timeout_s,
                                  json={"refit_id": refit_id, "version": weight_version, "timeout_s": budget},
                                  headers={"Authorization": f"Bearer {self.commit_token}"})
            if response.status_code >= 400:
                raise RuntimeError(f"apply of version {version} failed ({response.status_code}): {response.text}")
        with self._applied:
            if not self._applied.wait_for(lambda: version in self._outcomes, max(deadline - time.monotonic(), 0)):
                raise TimeoutError(f"version {version} was not applied within {timeout_s:.1f} s")
            ok, error = self._outcomes.pop(version)
        if not ok:
            raise RuntimeError(f"apply of version {version} failed: {error}")

    def applied(self, version: str, ok: bool, error: str = "") -> None:
        """The API server's word on an apply (through `collective_rpc`)."""
        with self._applied:
            self._outcomes[str(version)] = (ok, error)
            self._applied.notify_all()

    def abort(self) -> None:
        self.staging.discard()


class GeneratorMember:
    """Registration plus the agent; `close` leaves syncd and tears the groups down."""

    def __init__(self, client: MemberClient, endpoint: GeneratorEndpoint, agent: MemberAgent) -> None:
        self.client, self.endpoint, self.agent = client, endpoint, agent

    def close(self) -> None:
        self.agent.close()
        self.client.close()


def start_member(target: str, *, member_id: str, coords: dict[str, int], staging: Staging, group_size: int,
                 auth_token: str | None, commit_url: str, commit_token: str = "", data_host: str = "127.0.0.1",
                 in_flight: int = 2) -> GeneratorMember:
    client = MemberClient(target, role="generator", member_id=member_id, coords=coords, catalog=staging.catalog,
                          device=str(staging.device), data_address=data_host, auth_token=auth_token,
                          group_size=group_size,
                          # The engine starts on its --model checkpoint, which is no trainer version:
                          # it registers serving none, so syncd holds it not ready and catches it up.
                          weight_version=None)
    endpoint = GeneratorEndpoint(staging, member_id, commit_url, commit_token)
    agent = MemberAgent(client, endpoint, AgentSettings(host=data_host, device=str(staging.device),
                                                        in_flight=in_flight))
    client.start(agent)
    return GeneratorMember(client, endpoint, agent)
