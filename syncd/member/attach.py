"""Any PyTorch trainer as a weightsync sender, in one call.

    import syncd.member.attach as weightsync

    handle = weightsync.attach(model, syncd="syncd-host:8471", optimizer=optimizer, wait_s=300)
    for batch in data:
        loss = model(batch).loss; loss.backward()
        optimizer.step()         # announces version 1, 2, ...; returns once the generators serve it
        optimizer.zero_grad()
    handle.close()

Every rank calls `attach` after its model is parallelized (FSDP2 `fully_shard`, tensor parallel
`parallelize_module`, expert parallel: any DTensor placements) and after `init_process_group`.
`attach` reads this rank's catalog off the parameters (`syncd.member.dtensor`; plain tensors count
as replicated), maps their names to the generator's canonical tensors (`syncd.member.canonical_names`:
HF names of dense models and Qwen3-MoE built in, `names=` for anything else), refuses what it
cannot express before anything registers (`LayoutRefusedError`, naming every parameter, raised on
every rank alike), then registers the rank with syncd as `trainer-{rank}` and serves refits: the
data plane reads the live local shards in place, under a lock that the optimizer's step takes too,
so no step changes a parameter while it is being sent.

Versions: `handle.send(version)` announces that the parameters now hold `version` (syncd's
`--auto-refit` then starts a refit, or an operator does). With `optimizer=`, every
`optimizer.step()` is version 1, 2, ... and is sent automatically. A refit asks for the version it
moves: a rank that holds another one refuses, and the refit aborts rather than hand generators a
model torn between two versions.

Waiting (`wait_s`, `handle.wait_refit`) has one meaning: until every generator serves the version
(syncd's refit of it committed and every generator confirmed its install), or `RefitFailed`,
raised from `optimizer.step()` or `send`, naming the refit, its state, the member syncd recorded
and the reason (an aborted refit, a failed install, or, when no refit started in time, why: no
`--auto-refit`, a generator missing). `wait_s=None` never waits; `handle.last_refit` reads the
newest refit's outcome at any time. Versions are `syncd.weight_version.Version`s: syncd's label
and the step it came from, as a receiver's handle shows them.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterable, Mapping

import grpc
import torch
import torch.distributed as dist

from syncd.auth import resolve_token
from syncd.member.agent import MemberAgent
from syncd.member.canonical_names import UserNames
from syncd.member.dataplane import catalog_views
from syncd.member.dtensor import LayoutRefusedError, RankLayout, rank_layout
from syncd.member.membership import join
from syncd.member.refit_outcomes import RefitFailed, RefitOutcome, newest_outcome, wait_served
from syncd.member.sender import SenderEndpoint
from syncd.vocabulary import Role
from syncd.weight_version import Version, WeightVersion

__all__ = ["Attachment", "LayoutRefusedError", "RefitFailed", "RefitOutcome", "attach"]

log = logging.getLogger(__name__)


class _Parameters:
    """This rank's parameters as the trainer last labelled them: `lock` is held by every
    optimizer step and by a transfer (`SenderEndpoint`), `version` changes under it."""

    def __init__(self, layout: RankLayout) -> None:
        self.layout = layout
        self.lock = threading.Lock()
        self.version = WeightVersion(0)

    def views(self) -> Mapping[str, torch.Tensor]:
        # read the local shards at each transfer: FSDP2 and optimizers may have swapped storage
        return catalog_views(self.layout.catalog, self.layout.local_tensors())


class Attachment:
    """One rank's registration with syncd (from `attach`); `close()` leaves."""

    def __init__(
        self,
        client,
        agent: MemberAgent,
        endpoint: SenderEndpoint,
        parameters: _Parameters,
        wait_s: float | None,
    ) -> None:
        self.client, self.agent, self.endpoint, self.wait_s = client, agent, endpoint, wait_s
        self._parameters = parameters
        self._hooks: list = []
        self._last_refit: RefitOutcome | None = None  # the newest outcome heard, for when syncd is away

    @property
    def catalog(self):
        return self._parameters.layout.catalog

    @property
    def version(self) -> Version:
        """The version the parameters hold (0 before the first step)."""
        return Version.of_step(self._parameters.version)

    @property
    def last_refit(self) -> RefitOutcome | None:
        """The newest refit of this training run as syncd records it (id, version, state, reason,
        seconds, bytes), ended or still running; None before any. Asks syncd; when syncd does not
        answer, the newest outcome this handle heard."""
        try:
            self._last_refit = newest_outcome(self.client) or self._last_refit
        except (grpc.RpcError, RuntimeError) as e:
            log.info("%s: syncd did not answer for the last refit (%s)", self.client.member_id, e)
        return self._last_refit

    def wait_refit(self, version: int | Version, timeout_s: float = 600.0) -> RefitOutcome:
        """Block until every generator serves `version` (or a newer version of this run) and
        return the refit that did it; raise RefitFailed naming what happened instead."""
        step = version.step if isinstance(version, Version) else version
        if step is None:
            raise ValueError(f"version {version} names no trainer step")
        try:
            outcome = wait_served(self.client, WeightVersion(step), timeout_s)
        except RefitFailed as e:
            self._last_refit = e.outcome or self._last_refit
            log.warning("%s: %s", self.client.member_id, e)
            raise
        self._last_refit = outcome
        log.info("%s: %s; every generator serves it", self.client.member_id, outcome)
        return outcome

    def send(self, version: int, wait_s: float | None = None) -> RefitOutcome | None:
        """The parameters now hold `version`: announce it to syncd. Collective: every rank calls
        it, and no rank announces before all of them hold `version` (a refit that one rank's
        announcement starts must find every rank there). With `wait_s`, block as `wait_refit`
        does (raising RefitFailed) and return the refit's outcome."""
        v = WeightVersion(version)
        with self._parameters.lock:
            self._parameters.version = v
        if dist.is_initialized():
            dist.barrier()
        try:
            self.client.announce_version(v)
        except (grpc.RpcError, RuntimeError) as e:  # syncd down must not stop training
            # not lost: the client re-registers with the version it holds, which announces it
            log.warning("%s: could not announce version %d now (%s)", self.client.member_id, v, e)
        return None if wait_s is None else self.wait_refit(v, wait_s)

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        parameters = self._parameters

        def before_step(opt, args, kwargs) -> None:
            parameters.lock.acquire()

        def after_step(opt, args, kwargs) -> None:
            # relabel before anyone can read: a refit of the old version must not send new bytes
            parameters.version = WeightVersion(parameters.version + 1)
            parameters.lock.release()
            self.send(parameters.version, self.wait_s)  # raises RefitFailed out of optimizer.step()

        self._hooks += [
            optimizer.register_step_pre_hook(before_step),
            optimizer.register_step_post_hook(after_step),
        ]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self.agent.close()
        self.client.close()


def _agreed_layout(model: torch.nn.Module, names: UserNames | None, exclude: Iterable[str]) -> RankLayout:
    """This rank's layout, or `LayoutRefusedError` on every rank when any rank refuses."""
    layout, problems = None, {}
    try:
        layout = rank_layout(model.named_parameters(), names, exclude)
    except LayoutRefusedError as e:
        problems = e.problems
    if dist.is_initialized():
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, problems)
        problems = {}
        for rank, theirs in enumerate(everyone):
            for name, why in theirs.items():
                problems.setdefault(name, f"(rank {rank}) {why}")  # the lowest rank that refuses
    if problems:
        raise LayoutRefusedError(problems)
    assert layout is not None
    return layout


def attach(
    model: torch.nn.Module,
    *,
    syncd: str,
    names: UserNames | None = None,
    exclude: Iterable[str] = (),
    optimizer: torch.optim.Optimizer | None = None,
    wait_s: float | None = None,
    auth_token: str | None = None,
    auth_token_file: str | None = None,
    data_host: str = "127.0.0.1",
    in_flight: int = 2,
    register_timeout_s: float = 60.0,
) -> Attachment:
    """Register this rank's parameters with syncd at `syncd` (gRPC host:port) and serve refits.

    `names`: per parameter a canonical name or layout expression, or a function of (name, global
    shape); the built-in rules cover what it leaves out. `exclude`: parameters not to send.
    `optimizer`: send version 1, 2, ... after each of its steps; with `wait_s`, each step returns
    once every generator serves its version, or raises RefitFailed (`wait_refit`).
    `data_host`: the address peers reach this rank's data plane at. `auth_token` or
    `auth_token_file`: syncd's token; neither: from SYNCD_AUTH_TOKEN_FILE or SYNCD_AUTH_TOKEN
    (`syncd.auth`). Raises PermissionError when syncd refuses the token (saying whether none was
    given or it was wrong). Collective: every rank of the default process group calls it."""
    token = resolve_token(auth_token, auth_token_file)
    layout = _agreed_layout(model, names, exclude)
    rank = dist.get_rank() if dist.is_initialized() else 0
    run_id = [uuid.uuid4().hex]  # this training run, as syncd knows it: rank 0's id on every rank
    if dist.is_initialized():
        dist.broadcast_object_list(run_id, src=0)
    device = str(next(iter(layout.params.values())).device) if layout.params else "cpu"
    member_id = f"trainer-{rank}"
    parameters = _Parameters(layout)
    endpoint = SenderEndpoint(member_id, parameters, parameters.views)
    membership = join(
        syncd,
        endpoint,
        role=Role.TRAINER,
        member_id=member_id,
        coords={"pp": 0, "rank": rank},  # one data-plane group; ranks named by their global rank
        catalog=layout.catalog,
        device=device,
        data_host=data_host,
        auth_token=token,
        run_id=run_id[0],
        in_flight=in_flight,
    )
    client, agent = membership.client, membership.agent
    if not client.wait_registered(register_timeout_s):
        agent.close()
        client.close()
        if client.refusal is not None:
            raise PermissionError(f"{member_id}: syncd at {syncd} refused it: {client.refusal}")
        raise TimeoutError(
            f"{member_id}: syncd at {syncd} did not register it within {register_timeout_s:.0f} s"
        )
    handle = Attachment(client, agent, endpoint, parameters, wait_s)
    if optimizer is not None:
        handle._hook_optimizer(optimizer)
    return handle
