"""Request and response models of syncd's HTTP API (pydantic; they shape the OpenAPI document)."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from syncd.auth import Access
from syncd.daemon.adapter_refits import AdapterState
from syncd.daemon.digests import Difference, VersionDigest
from syncd.daemon.plan_cache import plan_members
from syncd.daemon.readiness import Readiness
from syncd.daemon.registry import Member
from syncd.daemon.store import RefitRecord
from syncd.plan import Plan
from syncd.weight_version import WeightVersion, WeightVersionJson


class HealthOut(BaseModel):
    status: str = "ok"


class ReadinessOut(BaseModel):
    ready: bool
    expected: dict[str, int] = Field(description="members needed per role")
    registered: dict[str, int] = Field(description="members with a live lease per role")
    reason: str = Field(
        description="why not ready; when ready, the generators missing (refits go on without them), or empty"
    )
    missing_generators: list[str] = Field(
        default_factory=list,
        description="generator workers registered once and not now; refits go on without them while "
        "every layout keeps --min-replicas-per-layout whole replicas",
    )

    @classmethod
    def of(cls, r: Readiness) -> ReadinessOut:
        return cls(
            ready=r.ready,
            expected={str(role): n for role, n in r.expected.items()},
            registered={str(role): n for role, n in r.registered.items()},
            reason=r.reason,
            missing_generators=list(r.missing),
        )


class MemberOut(BaseModel):
    member_id: str
    role: str
    coords: dict[str, int]
    device: str
    gpu_id: str = Field(default="", description="the UUID of the member's GPU; empty: none or unknown")
    data_address: str
    catalog_hash: str
    registered_at: float
    adapter: str = Field(default="", description="trainers of a named LoRA adapter: its name")
    lora_slots: bool = Field(default=False, description="generators: it takes adapters into slots")

    @classmethod
    def of(cls, m: Member) -> MemberOut:
        return cls(
            adapter=m.adapter.name if m.adapter is not None else "",
            lora_slots=m.lora_slots is not None,
            member_id=m.member_id,
            role=m.role,
            coords=dict(m.coords),
            device=m.device,
            gpu_id=m.gpu_id,
            data_address=m.data_address,
            catalog_hash=m.catalog_hash,
            registered_at=m.registered_at,
        )


class MembersOut(BaseModel):
    members: list[MemberOut]


class StageOut(BaseModel):
    stage: int
    bytes: int
    members: list[str]


class LinkOut(BaseModel):
    stage: int
    src: str
    dst: str
    bytes: int
    buckets: int
    units: int
    relay: bool = Field(default=False, description="src is a generator forwarding what it received (fan-out)")
    transport: str = Field(
        default="",
        description="what carries the link: shm (same host), cuda_ipc (shared GPU memory), gloo or nccl "
        "(syncd.plan.transports)",
    )


class PlanOut(BaseModel):
    total_bytes: int
    source_bytes: int = Field(
        description="bytes the trainers send (one copy per generator layout with fan-out)"
    )
    relay_bytes: int = Field(description="bytes generators forward to other replicas of their layout")
    buckets: int
    units: int
    bucket_bytes: int
    members: list[str]
    stages: list[StageOut]
    links: list[LinkOut]

    @classmethod
    def of(cls, plan: Plan, transports: Mapping[tuple[int, str, str], str]) -> PlanOut:
        """`transports`: per link (stage, src, dst), what carries it."""
        stage_bytes = plan.stage_bytes()
        return cls(
            total_bytes=plan.total_bytes,
            source_bytes=plan.source_bytes,
            relay_bytes=plan.relay_bytes,
            buckets=len(plan.buckets),
            units=plan.num_units,
            bucket_bytes=plan.bucket_bytes,
            members=list(plan_members(plan)),
            stages=[
                StageOut(stage=s, bytes=n, members=list(plan.stage_members.get(s, ())))
                for s, n in stage_bytes.items()
            ],
            links=[
                LinkOut(
                    stage=k.stage,
                    src=k.src,
                    dst=k.dst,
                    bytes=k.bytes,
                    buckets=k.buckets,
                    units=k.units,
                    relay=k.relay,
                    transport=transports.get((k.stage, k.src, k.dst), ""),
                )
                for k in plan.links()
            ],
        )


class RefitIn(BaseModel):
    # Strict: `true`, "7" and 7.0 are not versions; unknown fields are mistakes, not options.
    model_config = ConfigDict(extra="forbid")

    weight_version: WeightVersionJson | None = Field(
        default=None,
        description="version to move; must be the trainers' newest announced version (the default)",
    )
    allow_rollback: StrictBool = Field(
        default=False, description="allow moving a version older than the committed one of the same run"
    )
    full: StrictBool = Field(
        default=False, description="move every byte even where delta refits are on (no delta links)"
    )
    adapter: StrictStr | None = Field(
        default=None,
        description="refit this named LoRA adapter into the generators' slots, not the base weights "
        "(weight_version is then the adapter's)",
    )


class RefitOut(BaseModel):
    id: str
    state: str = Field(description="PREPARING, TRANSFERRING, VERIFYING, COMMITTED or ABORTED")
    weight_version: WeightVersion
    created_at: float
    finished_at: float | None
    error: str = Field(description="the cause when ABORTED; when COMMITTED, why members are unconfirmed")
    phases: dict[str, float] = Field(description="seconds spent per phase")
    bytes: int = Field(description="bytes received by generators, as they reported after TRANSFERRING")
    planned_bytes: int = Field(
        description="bytes the plan moves to generators; set once TRANSFERRING "
        "starts, so a refit cut short still shows what it was moving"
    )
    run_id: str = Field(description="training run of weight_version; the pair names one weight set")
    unconfirmed: list[str] = Field(
        description="COMMITTED: members that did not confirm Commit (the cause is in `error`)"
    )
    mode: str = Field(description="delta (some generator received only what changed) or full")
    delta_generators: list[str] = Field(description="generators that received only what changed")
    changed_fraction: float | None = Field(
        description="of the elements on delta links, the fraction that changed; null for a full refit"
    )
    saved_bytes: int = Field(description="bytes of planned_bytes that delta links did not move")
    left_out: list[str] = Field(
        default_factory=list,
        description="generators the refit went without: missing when it was triggered (refits go "
        "on over the replicas there), or lost by the refit it retries",
    )
    adapter: str = Field(
        default="",
        description="a refit of this named adapter into the generators' slots (weight_version and "
        "bytes are the adapter's); empty for the base weights",
    )

    @classmethod
    def of(cls, r: RefitRecord) -> RefitOut:
        return cls(
            id=r.id,
            state=r.state,
            weight_version=r.weight_version,
            created_at=r.created_at,
            finished_at=r.finished_at,
            error=r.error,
            phases=r.phases,
            bytes=r.bytes,
            planned_bytes=r.planned_bytes,
            run_id=r.run_id,
            unconfirmed=list(r.unconfirmed),
            mode=r.mode,
            delta_generators=list(r.delta_generators),
            changed_fraction=r.changed_fraction,
            saved_bytes=r.saved_bytes,
            left_out=list(r.left_out),
            adapter=r.adapter,
        )


class RefitsOut(BaseModel):
    refits: list[RefitOut] = Field(description="newest first")


class StatusOut(BaseModel):
    state: str = Field(description="IDLE, or the running refit's state")
    current_refit: RefitOut | None
    committed_version: WeightVersion | None
    committed_run: str | None = Field(description="training run of committed_version")
    announced_version: WeightVersion | None = Field(
        description="newest version the current training run announced"
    )
    announced_run: str | None = Field(description="the trainers' current training run")
    readiness: ReadinessOut
    access: Access = Field(
        description="who may trigger refits and join: token (callers with syncd's token), loopback "
        "(no token; syncd's own host only), insecure-no-auth (no token; whoever reaches syncd)"
    )
    insecure_no_auth: bool = Field(
        description="syncd serves open by --insecure-no-auth: anyone who reaches it may trigger "
        "refits or join as a member and be sent the weights"
    )


class DigestOut(BaseModel):
    run_id: str
    weight_version: WeightVersionJson
    members: dict[str, dict[str, str]] = Field(
        description="per receiving member: region (canonical tensor and box) -> the senders' checksum"
    )

    @classmethod
    def of(cls, d: VersionDigest) -> DigestOut:
        return cls(
            run_id=d.run_id,
            weight_version=d.weight_version,
            members={m: dict(c) for m, c in d.members.items()},
        )


class MemberDigestIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_version: WeightVersionJson = Field(description="the version the member serves")
    checksums: dict[str, str] = Field(description="region -> checksum of what the member holds")


class VerifyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    members: dict[str, MemberDigestIn] = Field(description="member id -> its digest")


class DifferenceOut(BaseModel):
    member_id: str
    tensor: str
    region: str
    expected: str = Field(description="the senders' checksum; empty when syncd has none")
    got: str = Field(description="the member's; empty when it reported none")

    @classmethod
    def of(cls, d: Difference) -> DifferenceOut:
        return cls(member_id=d.member_id, tensor=d.tensor, region=d.region, expected=d.expected, got=d.got)


class VerifyOut(BaseModel):
    equal: bool
    regions_compared: int
    tensors: list[str] = Field(description="the canonical tensors that differ, sorted")
    differences: list[DifferenceOut]


class AdapterOut(BaseModel):
    name: str = Field(description="what requests name as their model")
    rank: int | None = Field(description="its spec, as its live trainers registered it; null: none is live")
    alpha: float | None
    target_modules: list[str]
    trainers: list[str] = Field(description="the live trainers that send it")
    run_id: str = Field(description="its trainers' current run")
    announced_version: WeightVersion | None = Field(description="newest version its run announced")
    committed_version: WeightVersion | None = Field(description="the version the generators' slots hold")
    committed_run: str | None = Field(description="the run of committed_version")

    @classmethod
    def of(cls, name: str, trainers: list[Member], state: AdapterState) -> AdapterOut:
        spec = trainers[0].adapter if trainers else None
        committed = state.committed
        return cls(
            name=name,
            rank=spec.rank if spec else None,
            alpha=spec.alpha if spec else None,
            target_modules=list(spec.target_modules) if spec else [],
            trainers=[m.member_id for m in trainers],
            run_id=state.run_id,
            announced_version=state.announced,
            committed_version=committed.version if committed else None,
            committed_run=committed.run_id if committed else None,
        )


class AdaptersOut(BaseModel):
    adapters: list[AdapterOut] = Field(description="by name: every adapter a trainer registered")
