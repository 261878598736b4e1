"""The member side of the data plane: turns syncd's commands into transfers.

    agent = MemberAgent(client, endpoint, AgentSettings(host=my_ip, device="cuda:0"))
    client.start(agent)

`endpoint` is what the member exposes (a trainer rank's parameter views, a generator worker's
staging area); the agent is the same for both roles:

- JoinGroup: rank 0 creates the rendezvous address (gloo) or NCCL unique id, reports it
  (GROUP_ADDRESS) before it blocks in init; the others join with the address syncd relays; all
  report JOINED. One transport per PP stage, kept across refits until syncd regroups or aborts.
- ExecutePlan: one thread per stage group, all stages concurrently, each sending or receiving its
  buckets; then TRANSFERRED with bytes, per-unit checksums and timings.
- Verify / Commit: handed to the endpoint, then VERIFIED / COMMITTED. The endpoint hears `begin`
  before and `end` after its own transfer, so a trainer holds its weights still only that long.
- Abort (arrives on its own thread): cancel the transfer, abort every communicator so no peer
  waits for us, let the endpoint drop what it staged, report ABORTED.

The parts, by responsibility:

- `member_agent` (`MemberAgent`): the facade, a handler per command;
- `endpoint` (`Endpoint`, `Reporter`) and `settings` (`AgentSettings`): what it is given;
- `groups` (`JoinedGroups`) and `join` (`join_group`): the stage groups, one per backend's way in;
- `loop_args` (`RefitTransfer`, `StageTransfer`): the loops' arguments, built once per refit;
- `stage_loops`: which loop carries a stage's part (a table by `LoopKind`);
- `transfer`: the stage threads, and the TRANSFERRED report;
- `mirror` (`SenderMirror`): a sender's mirror while delta refits are on, updated on Verify.
"""

from syncd.member.agent.endpoint import Endpoint, Reporter
from syncd.member.agent.member_agent import MemberAgent
from syncd.member.agent.settings import AgentSettings

__all__ = ["AgentSettings", "Endpoint", "MemberAgent", "Reporter"]
