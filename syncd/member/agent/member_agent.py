"""The agent: the one object a member's client calls with syncd's commands (`MemberAgent`). A thin
facade over the parts it wires together, one handler per command (`_handlers`):

- JoinGroup: `join.join_group` (into `groups.JoinedGroups`);
- ExecutePlan: the endpoint's `begin`, this refit's loop arguments (`loop_args.RefitTransfer`),
  `transfer.transfer` (while `progress.reporting` tells syncd what arrived so far), the
  endpoint's `end` (a sender with delta refits on: on Verify, `mirror`);
- Verify / Commit: handed to the endpoint, then VERIFIED / COMMITTED;
- Abort (arrives on its own thread): cancel the transfer, close every group, drop the mirror's
  update, let the endpoint drop what it staged, report ABORTED.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from syncd.commands import Abort, Command, Commit, ExecutePlan, JoinGroup, Phase, Verify
from syncd.member.agent.endpoint import Endpoint, Reporter
from syncd.member.agent.groups import JoinedGroups
from syncd.member.agent.join import join_group
from syncd.member.agent.loop_args import RefitTransfer
from syncd.member.agent.mirror import MirrorUpdate, SenderMirror
from syncd.member.agent.progress import reporting, sender_of
from syncd.member.agent.settings import AgentSettings
from syncd.member.agent.transfer import transfer
from syncd.member.dataplane import GcPause
from syncd.member.dataplane.delta import Mirror
from syncd.member.dataplane.landing_fault import armed
from syncd.member.dataplane.prepared import ReceiveSink
from syncd.member.dataplane.shm import sweep_orphans

log = logging.getLogger(__name__)

# Read once, at import, as a default argument would be (`landing_fault_file` comes from the env).
_DEFAULT_SETTINGS = AgentSettings()


class MemberAgent:
    def __init__(self, client: Reporter, endpoint: Endpoint, settings: AgentSettings = _DEFAULT_SETTINGS):
        self._client, self._endpoint, self._settings = client, endpoint, settings
        self._groups = JoinedGroups()
        self._cancel = threading.Event()
        self._gc_pause = GcPause() if settings.pause_gc else None
        self._mirror = SenderMirror(endpoint)
        self._handlers: dict[type, Callable[[Any], None]] = {
            JoinGroup: self._join,
            ExecutePlan: self._execute,
            Verify: self._verify,
            Commit: self._commit,
            Abort: self._abort,
        }

    @property
    def member_id(self) -> str:
        return self._client.member_id

    @property
    def mirror(self) -> Mirror | None:
        """Senders, while delta refits are on: what they last sent (`SenderMirror`)."""
        return self._mirror.mirror

    def __call__(self, command: Command) -> None:
        handler = self._handlers.get(type(command))
        if handler is not None:
            handler(command)

    def _join(self, cmd: JoinGroup) -> None:
        join_group(cmd, self._client, self._settings, self._groups)

    def _execute(self, cmd: ExecutePlan) -> None:
        self._mirror.drop()  # an earlier refit's update that got no Verify (it failed elsewhere)
        self._cancel.clear()
        tensors = self._begin(cmd)
        update: MirrorUpdate | None = None
        ok = False
        try:
            update = self._transfer(cmd, tensors)
            ok = True
        finally:
            self._groups.end_shared_memory()
            if update is None:
                self._endpoint.end(cmd.refit_id, ok)
        if update is not None:  # the weights stay held until the mirror took them, on Verify
            self._mirror.hold(update, self._cancel)

    def _begin(self, cmd: ExecutePlan) -> Mapping[str, torch.Tensor] | ReceiveSink:
        """The endpoint's tensors for this refit; a receiver of a named adapter's refit gets them
        from its `begin_adapter` (the adapter's slot tensors, `syncd.layout.adapters`)."""
        if cmd.adapter is None or not any(b.dst == self.member_id for b in cmd.buckets):
            return self._endpoint.begin(cmd.refit_id, cmd.weight_version, cmd.buckets)
        begin_adapter = getattr(self._endpoint, "begin_adapter", None)
        if begin_adapter is None:
            raise RuntimeError(
                f"{self.member_id} takes no adapters into slots, but refit {cmd.refit_id} sends it "
                f"adapter {cmd.adapter.name!r}"
            )
        tensors: Mapping[str, torch.Tensor] = begin_adapter(
            cmd.refit_id, cmd.weight_version, cmd.buckets, cmd.adapter
        )
        return tensors

    def _transfer(
        self, cmd: ExecutePlan, tensors: Mapping[str, torch.Tensor] | ReceiveSink
    ) -> MirrorUpdate | None:
        """Runs this member's part of the plan and reports it; a sender with delta refits on
        returns its mirror's update, for Verify."""
        delta_part = self._mirror.delta_part(cmd, self.member_id)
        fault = armed(self._settings.landing_fault_file)
        if fault is not None:
            log.warning("%s: test fault %s armed for refit %s", self.member_id, fault, cmd.refit_id)
        receives = any(b.dst == self.member_id for b in cmd.buckets)  # only receivers report progress
        send = sender_of(self._client) if receives else None
        with reporting(send, cmd.refit_id, self._settings.progress_interval_s) as arrived:
            refit = RefitTransfer.of(
                cmd,
                self.member_id,
                tensors,
                self._cancel,
                self._settings,
                self._gc_pause,
                fault,
                delta_part,
                arrived,
            )
            transfer(refit, cmd, self._groups, self._endpoint, self._client)
        if refit.diffs is None:
            return None
        assert isinstance(tensors, Mapping)  # diffs are a sender's, and a sender names its tensors
        return MirrorUpdate(cmd.refit_id, cmd.weight_version, refit.diffs, tensors)

    def _verify(self, cmd: Verify) -> None:
        self._endpoint.verify(cmd.refit_id)
        self._client.report(cmd.refit_id, Phase.VERIFIED)
        self._mirror.update_on_verify(cmd.refit_id)

    def _commit(self, cmd: Commit) -> None:
        self._endpoint.commit(cmd.refit_id, cmd.weight_version, cmd.timeout_s)
        self._client.report(cmd.refit_id, Phase.COMMITTED)

    def _abort(self, cmd: Abort) -> None:
        log.warning("%s: abort %s: %s", self.member_id, cmd.refit_id, cmd.reason)
        self._cancel.set()
        self._groups.close_all()
        sweep_orphans()  # a local peer killed mid-refit left its segments' names
        self._mirror.drop()
        self._endpoint.abort()
        self._client.report(cmd.refit_id, Phase.ABORTED)

    def close(self) -> None:
        self._mirror.drop()
        self._groups.close_all()
