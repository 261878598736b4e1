"""The member library's front door: one call makes this process a member of syncd.

    member = syncd.member.join(
        "syncd:8471", endpoint, role=Role.GENERATOR, member_id="generator-0-0",
        coords={"replica": 0, "tp": 0}, catalog=catalog, device="cuda:0", data_host=my_ip,
    )
    ...
    member.close()

`join` wires what every member needs, the same way for both roles: a `MemberClient` (register,
heartbeat, Watch), a `MemberAgent` that carries out syncd's commands through the member's
`endpoint` (what it exposes to the data plane: a trainer rank's parameter views, a generator
worker's staging area), and starts the client with the agent as its handler. The returned
`Membership` owns both; `close` leaves syncd and tears the data-plane groups down.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from syncd.layout import Catalog
from syncd.layout.adapters import AdapterSpec, LoraSlots
from syncd.member.agent import AgentSettings, Endpoint, MemberAgent
from syncd.member.client import MemberClient
from syncd.vocabulary import Role
from syncd.weight_version import WeightVersion


@dataclass
class Membership:
    """One joined member: its client (`announce_version`, `wait_registered`, the versions syncd
    told it) and its agent. Close it once; it closes the agent's groups, then the client."""

    client: MemberClient
    agent: MemberAgent
    endpoint: Endpoint

    @property
    def member_id(self) -> str:
        return self.client.member_id

    def close(self) -> None:
        self.agent.close()
        self.client.close()


def join(
    target: str,
    endpoint: Endpoint,
    *,
    role: Role,
    member_id: str,
    coords: Mapping[str, int],
    catalog: Catalog,
    device: str = "cpu",
    data_host: str = "127.0.0.1",
    auth_token: str | None = None,
    run_id: str = "",
    weight_version: WeightVersion | None = None,
    receive_by_layer: bool = False,
    in_flight: int = 2,
    adapter: AdapterSpec | None = None,
    lora_slots: LoraSlots | None = None,
) -> Membership:
    """Register with syncd at `target` (host:port of its gRPC server) as `member_id` and serve its
    commands through `endpoint`; returns at once (registration goes on in the background:
    `Membership.client.wait_registered`).

    role, member_id, coords, catalog: who this member is and what it holds (`MemberClient`).
    device: where its tensors live ("cpu", "cuda:0"); the data plane picks gloo or NCCL from it.
    data_host: the address its data-plane peers reach it at (reported, and bound by a gloo store
        it hosts).
    auth_token: syncd's bearer token, when it requires one.
    run_id: trainers: the training run (the same on every rank of one job).
    weight_version: the version it holds or serves now (None: none of a trainer's).
    receive_by_layer: generators that install layer by layer ask for buckets cut at layers.
    in_flight: staging buffers per stage and direction (`syncd.member.dataplane.LoopOptions`).
    adapter: trainers of one named LoRA adapter: its spec (the catalog holds its factors only).
    lora_slots: generators whose engine takes adapters into slots (`syncd.layout.adapters`).
    """
    client = MemberClient(
        target,
        role=role,
        member_id=member_id,
        coords=dict(coords),
        catalog=catalog,
        device=device,
        data_address=data_host,
        auth_token=auth_token,
        run_id=run_id,
        weight_version=weight_version,
        receive_by_layer=receive_by_layer,
        adapter=adapter,
        lora_slots=lora_slots,
    )
    agent = MemberAgent(client, endpoint, AgentSettings(host=data_host, device=device, in_flight=in_flight))
    client.start(agent)
    return Membership(client, agent, endpoint)
