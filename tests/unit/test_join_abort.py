"""An Abort ends a join in progress: a member whose group's other rank was lost while the group
formed does not sit in gloo's rendezvous until the join's timeout, so the commands after the
Abort (the retry's groups) run at once."""

from __future__ import annotations

import threading

from syncd.commands import JoinGroup
from syncd.member.agent.groups import JoinedGroups
from syncd.member.agent.join import join_group
from syncd.member.agent.settings import AgentSettings
from syncd.member.dataplane import GlooTransport
from syncd.vocabulary import Backend
from tests.polling import wait_until


class _Reports:
    member_id = "generator-0-0"

    def __init__(self) -> None:
        self.phases: list[str] = []

    def report(self, refit_id: str, phase, **fields) -> None:
        self.phases.append(str(phase))


def test_an_abort_ends_a_join_whose_peer_never_comes() -> None:
    address, store = GlooTransport.create_address("127.0.0.1", 2, 60)  # rank 0 is lost: never joins
    groups, reports = JoinedGroups(), _Reports()
    cmd = JoinGroup("refit-1", "refit-1/stage0", 0, 1, 2, Backend.GLOO, address, ("t", "g"), 60.0)
    failed: list[BaseException] = []

    def join() -> None:
        try:
            join_group(cmd, reports, AgentSettings(), groups)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            failed.append(e)

    joining = threading.Thread(target=join)
    joining.start()
    wait_until(
        lambda: any(t.name == f"join-{cmd.group_id}" for t in threading.enumerate()), what="the rendezvous"
    )
    groups.close_all()  # what the agent does on Abort
    joining.join(5)
    assert not joining.is_alive(), "the join outlived the abort by 5 s"
    assert len(failed) == 1 and "aborted" in str(failed[0]), failed
    assert "JOINED" not in reports.phases
    assert groups.get(0) is None
    del store


def test_a_join_that_forms_is_kept() -> None:
    groups, reports = JoinedGroups(), _Reports()
    cmd = JoinGroup("refit-1", "refit-1/stage0", 0, 0, 1, Backend.GLOO, "", ("g",), 30.0)
    join_group(cmd, reports, AgentSettings(), groups)
    group = groups.get(0)
    assert group is not None and reports.phases[-1] == "JOINED"
    groups.close_all()
