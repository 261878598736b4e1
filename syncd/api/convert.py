"""Conversions between the layout/plan/command dataclasses and their protobuf messages.

The only module that knows both sides. Decoding foreign input may raise ValueError (e.g. an empty
box); callers translate that into INVALID_ARGUMENT.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

from syncd import commands
from syncd.api import syncd_pb2 as pb
from syncd.layout import Box, CanonicalTensor, Catalog, LocalTensor, Piece, dtype_bytes
from syncd.layout.adapters import AdapterSpec, LoraSlots
from syncd.plan.types import Bucket, Relay, TransferUnit
from syncd.vocabulary import Backend, Fp8Part, LinkTransport, Role
from syncd.weight_version import WeightVersion

ROLES = {Role.TRAINER: pb.ROLE_TRAINER, Role.GENERATOR: pb.ROLE_GENERATOR}
ROLE_NAMES = {v: k for k, v in ROLES.items()}
PHASES = {name: pb.Phase.Value(f"PHASE_{name}") for name in (*commands.Phase, "ANNOUNCE")}
PHASE_NAMES = {v: k for k, v in PHASES.items()}

_V = TypeVar("_V", bound=StrEnum)


def role_to_pb(role: Role) -> pb.Role:
    try:
        return ROLES[role]
    except KeyError:
        raise ValueError(f"unknown role {role!r}; expected one of {sorted(map(str, ROLES))}") from None


def phase_to_pb(phase: commands.Phase) -> pb.Phase:
    try:
        return PHASES[phase]
    except KeyError:
        raise ValueError(f"unknown phase {phase!r}; expected one of {sorted(PHASES)}") from None


def _vocabulary_from_pb(enum: type[_V], field: str, value: str) -> _V:
    """A vocabulary's member from a command's text field, or a ValueError that names the field."""
    try:
        return enum(value)
    except ValueError:
        known = ", ".join(repr(str(v)) for v in enum)
        raise ValueError(f"{field} {value!r} is not a {enum.__name__}; expected one of {known}") from None


# ---- layout ----


def box_to_pb(box: Box) -> pb.Box:
    return pb.Box(start=box.start, stop=box.stop)


def box_from_pb(msg: pb.Box) -> Box:
    return Box(tuple(msg.start), tuple(msg.stop))


def catalog_to_pb(catalog: Catalog) -> pb.Catalog:
    return pb.Catalog(
        canonical=[pb.CanonicalTensor(name=c.name, shape=c.shape, dtype=c.dtype) for c in catalog.canonical],
        tensors=[
            pb.LocalTensor(
                name=t.name,
                shape=t.shape,
                dtype=t.dtype,
                pieces=[
                    pb.Piece(canonical=p.canonical, canon=box_to_pb(p.canon), local=box_to_pb(p.local))
                    for p in t.pieces
                ],
            )
            for t in catalog.tensors
        ],
        partial=catalog.partial,
    )


def catalog_from_pb(msg: pb.Catalog) -> Catalog:
    return Catalog(
        canonical=tuple(CanonicalTensor(c.name, tuple(c.shape), c.dtype) for c in msg.canonical),
        tensors=tuple(
            LocalTensor(
                t.name,
                tuple(t.shape),
                t.dtype,
                tuple(Piece(p.canonical, box_from_pb(p.canon), box_from_pb(p.local)) for p in t.pieces),
            )
            for t in msg.tensors
        ),
        partial=msg.partial,
    )


# ---- plan ----


def unit_to_pb(u: TransferUnit) -> pb.TransferUnit:
    return pb.TransferUnit(
        canonical=u.canonical,
        canon=box_to_pb(u.canon),
        dtype=u.dtype,
        src_tensor=u.src_tensor,
        src_box=box_to_pb(u.src_box),
        dst_tensor=u.dst_tensor,
        dst_box=box_to_pb(u.dst_box),
        nbytes=u.nbytes,
        quantized=u.quantized or "",
        src_dtype=u.src_dtype or "",
        block_box=box_to_pb(u.block_box) if u.block_box else None,
    )


def unit_from_pb(m: pb.TransferUnit) -> TransferUnit:
    return TransferUnit(
        canonical=m.canonical,
        canon=box_from_pb(m.canon),
        dtype=m.dtype,
        src_tensor=m.src_tensor,
        src_box=box_from_pb(m.src_box),
        dst_tensor=m.dst_tensor,
        dst_box=box_from_pb(m.dst_box),
        nbytes=m.nbytes,
        quantized=Fp8Part(m.quantized) if m.quantized else None,
        src_dtype=m.src_dtype or None,
        block_box=box_from_pb(m.block_box) if m.HasField("block_box") else None,
    )


def bucket_to_pb(b: Bucket) -> pb.Bucket:
    return pb.Bucket(
        stage=b.stage,
        src=b.src,
        dst=b.dst,
        index=b.index,
        units=[unit_to_pb(u) for u in b.units],
        nbytes=b.nbytes,
        relay=None if b.relay is None else _relay_to_pb(b.relay),
    )


def _relay_to_pb(r: Relay) -> pb.Relay:
    src, dst, index = r.forwards
    return pb.Relay(origin=r.origin, forwards_src=src, forwards_dst=dst, forwards_index=index)


def bucket_from_pb(m: pb.Bucket) -> Bucket:
    return Bucket(
        stage=m.stage,
        src=m.src,
        dst=m.dst,
        index=m.index,
        units=tuple(unit_from_pb(u) for u in m.units),
        nbytes=m.nbytes,
        relay=(
            Relay(m.relay.origin, (m.relay.forwards_src, m.relay.forwards_dst, m.relay.forwards_index))
            if m.HasField("relay")
            else None
        ),
    )


# The last plan this process decoded, by its wire bytes. syncd sends the same plan refit after
# refit while the layouts stay, and the data plane keeps per-bucket work (prepared copies and
# views, CUDA graphs) keyed by the bucket objects; decoding anew would make new objects every
# refit, and costs tens of milliseconds of Python for a large model besides.
_LAST_PLAN: tuple[bytes, tuple[Bucket, ...]] = (b"", ())


def _buckets_from_pb(buckets) -> tuple[Bucket, ...]:
    global _LAST_PLAN
    wire = pb.ExecutePlan(buckets=buckets).SerializeToString(deterministic=True)
    last_wire, last = _LAST_PLAN
    if wire == last_wire and last:
        return last
    decoded = tuple(bucket_from_pb(b) for b in buckets)
    _LAST_PLAN = (wire, decoded)  # one tuple assignment: a concurrent decoder sees old or new
    return decoded


# ---- commands ----


def _group_to_pb(g: commands.StageGroup) -> pb.StageGroup:
    return pb.StageGroup(stage=g.stage, group_id=g.group_id, backend=g.backend, members=g.members)


def command_to_pb(cmd: commands.Command) -> pb.Command:
    match cmd:
        case commands.JoinGroup():
            return pb.Command(
                join_group=pb.JoinGroup(
                    refit_id=cmd.refit_id,
                    group_id=cmd.group_id,
                    stage=cmd.stage,
                    rank=cmd.rank,
                    world_size=cmd.world_size,
                    backend=cmd.backend,
                    address=cmd.address,
                    members=cmd.members,
                    timeout_s=cmd.timeout_s,
                    links=cmd.links,
                )
            )
        case commands.ExecutePlan():
            return pb.Command(
                execute_plan=pb.ExecutePlan(
                    refit_id=cmd.refit_id,
                    weight_version=cmd.weight_version,
                    buckets=[bucket_to_pb(b) for b in cmd.buckets],
                    groups=[_group_to_pb(g) for g in cmd.groups],
                    timeout_s=cmd.timeout_s,
                    delta=_delta_to_pb(cmd.delta),
                    stall_timeout_s=cmd.stall_timeout_s,
                    ipc_links=[pb.LinkRef(stage=k[0], src=k[1], dst=k[2]) for k in sorted(cmd.ipc_links)],
                    adapter=adapter_to_pb(cmd.adapter),
                )
            )
        case commands.Verify():
            return pb.Command(
                verify=pb.Verify(
                    refit_id=cmd.refit_id, weight_version=cmd.weight_version, timeout_s=cmd.timeout_s
                )
            )
        case commands.Commit():
            return pb.Command(
                commit=pb.Commit(
                    refit_id=cmd.refit_id,
                    weight_version=cmd.weight_version,
                    timeout_s=cmd.timeout_s,
                    run_id=cmd.run_id,
                    adapter=cmd.adapter,
                )
            )
        case commands.Abort():
            return pb.Command(abort=pb.Abort(refit_id=cmd.refit_id, reason=cmd.reason))
    raise TypeError(f"not a command: {cmd!r}")


def _delta_to_pb(delta: commands.DeltaLinks | None) -> pb.DeltaLinks | None:
    if delta is None:
        return None
    return pb.DeltaLinks(
        base=-1 if delta.base is None else delta.base,
        dsts=sorted(delta.dsts),
        max_fraction=delta.max_fraction,
    )


def _delta_from_pb(m: pb.ExecutePlan) -> commands.DeltaLinks | None:
    if not m.HasField("delta"):
        return None
    d = m.delta
    base = None if d.base < 0 else WeightVersion(d.base)  # syncd sent it: a WeightVersion or -1
    return commands.DeltaLinks(base, frozenset(d.dsts), d.max_fraction)


def _stage_group_from_pb(g: pb.StageGroup) -> commands.StageGroup:
    backend = _vocabulary_from_pb(Backend, "StageGroup.backend", g.backend)
    return commands.StageGroup(g.stage, g.group_id, backend, tuple(g.members))


def command_from_pb(msg: pb.Command) -> commands.Command:
    kind = msg.WhichOneof("kind")
    if kind == "join_group":
        m = msg.join_group
        return commands.JoinGroup(
            m.refit_id,
            m.group_id,
            m.stage,
            m.rank,
            m.world_size,
            _vocabulary_from_pb(Backend, "JoinGroup.backend", m.backend),
            m.address,
            tuple(m.members),
            m.timeout_s,
            tuple(_vocabulary_from_pb(LinkTransport, "JoinGroup.links", link) for link in m.links),
        )
    if kind == "execute_plan":
        m = msg.execute_plan
        return commands.ExecutePlan(
            m.refit_id,
            WeightVersion(m.weight_version),  # versions syncd sends are WeightVersions
            _buckets_from_pb(m.buckets),
            tuple(_stage_group_from_pb(g) for g in m.groups),
            m.timeout_s,
            _delta_from_pb(m),
            m.stall_timeout_s,
            frozenset((k.stage, k.src, k.dst) for k in m.ipc_links),
            adapter_from_pb(m.adapter) if m.HasField("adapter") else None,
        )
    if kind == "verify":
        v = msg.verify
        return commands.Verify(v.refit_id, WeightVersion(v.weight_version), v.timeout_s)
    if kind == "commit":
        m = msg.commit
        return commands.Commit(m.refit_id, WeightVersion(m.weight_version), m.timeout_s, m.run_id, m.adapter)
    if kind == "abort":
        return commands.Abort(msg.abort.refit_id, msg.abort.reason)
    raise ValueError(f"command without a kind: {msg!r}")


# ---- adapter slots ----


def adapter_to_pb(spec: AdapterSpec | None) -> pb.AdapterSpec | None:
    if spec is None:
        return None
    return pb.AdapterSpec(
        name=spec.name, rank=spec.rank, alpha=spec.alpha, target_modules=list(spec.target_modules)
    )


def adapter_from_pb(m: pb.AdapterSpec) -> AdapterSpec:
    """Raises ValueError naming what is wrong with a foreign spec."""
    spec = AdapterSpec(m.name, m.rank, m.alpha, tuple(m.target_modules))
    spec.validate()
    return spec


def lora_slots_to_pb(slots: LoraSlots | None) -> pb.LoraSlots | None:
    if slots is None:
        return None
    return pb.LoraSlots(max_rank=slots.max_rank, max_loras=slots.max_loras, dtype=slots.dtype)


def lora_slots_from_pb(m: pb.LoraSlots) -> LoraSlots:
    """Raises ValueError naming what is wrong with a foreign description."""
    if m.max_rank <= 0 or m.max_loras <= 0:
        raise ValueError(f"lora_slots: max_rank {m.max_rank} and max_loras {m.max_loras} must be positive")
    dtype_bytes(m.dtype)
    return LoraSlots(m.max_rank, m.max_loras, m.dtype)


# ---- reports ----


def report_to_pb(r: commands.MemberReport) -> pb.ReportRequest:
    """A member's answer as it travels (syncd fills in the member from the session)."""
    return pb.ReportRequest(
        member_id=r.member_id,
        refit_id=r.refit_id,
        phase=phase_to_pb(r.phase),
        ok=r.ok,
        error=r.error,
        bytes=r.bytes,
        checksums=dict(r.checksums),
        timings=dict(r.timings),
        address=r.address,
        delta_elements=r.delta_elements,
        changed_elements=r.changed_elements,
    )


def report_from_pb(m: pb.ReportRequest, member_id: str) -> commands.MemberReport:
    """The answer of member `member_id` (its session's, not what the message claims)."""
    return commands.MemberReport(
        member_id=member_id,
        refit_id=m.refit_id,
        phase=commands.Phase(PHASE_NAMES[m.phase]),
        ok=m.ok,
        error=m.error,
        bytes=m.bytes,
        checksums=dict(m.checksums),
        timings=dict(m.timings),
        address=m.address,
        delta_elements=m.delta_elements,
        changed_elements=m.changed_elements,
    )


# ---- progress ----


def progress_to_pb(r: commands.ProgressReport) -> pb.ProgressRequest:
    return pb.ProgressRequest(
        member_id=r.member_id,
        refit_id=r.refit_id,
        links=[pb.LinkProgress(stage=stage, src=src, bytes=n) for (stage, src), n in sorted(r.links.items())],
    )


def progress_from_pb(m: pb.ProgressRequest, member_id: str) -> commands.ProgressReport:
    """The progress of member `member_id` (its session's, not what the message claims)."""
    links: dict[tuple[int, str], int] = {}
    for link in m.links:
        if link.bytes < 0:
            raise ValueError(f"progress from {member_id}: link {link.src} -> it has {link.bytes} bytes")
        links[(link.stage, link.src)] = link.bytes
    return commands.ProgressReport(member_id, m.refit_id, links)
