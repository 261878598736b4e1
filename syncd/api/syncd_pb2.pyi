from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_TRAINER: _ClassVar[Role]
    ROLE_GENERATOR: _ClassVar[Role]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_GROUP_ADDRESS: _ClassVar[Phase]
    PHASE_JOINED: _ClassVar[Phase]
    PHASE_TRANSFERRED: _ClassVar[Phase]
    PHASE_VERIFIED: _ClassVar[Phase]
    PHASE_COMMITTED: _ClassVar[Phase]
    PHASE_ABORTED: _ClassVar[Phase]
    PHASE_ANNOUNCE: _ClassVar[Phase]
ROLE_UNSPECIFIED: Role
ROLE_TRAINER: Role
ROLE_GENERATOR: Role
PHASE_UNSPECIFIED: Phase
PHASE_GROUP_ADDRESS: Phase
PHASE_JOINED: Phase
PHASE_TRANSFERRED: Phase
PHASE_VERIFIED: Phase
PHASE_COMMITTED: Phase
PHASE_ABORTED: Phase
PHASE_ANNOUNCE: Phase

class Box(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[int]] = ...) -> None: ...

class CanonicalTensor(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class Piece(_message.Message):
    __slots__ = ("canonical", "canon", "local")
    CANONICAL_FIELD_NUMBER: _ClassVar[int]
    CANON_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    canonical: str
    canon: Box
    local: Box
    def __init__(self, canonical: _Optional[str] = ..., canon: _Optional[_Union[Box, _Mapping]] = ..., local: _Optional[_Union[Box, _Mapping]] = ...) -> None: ...

class LocalTensor(_message.Message):
    __slots__ = ("name", "shape", "dtype", "pieces")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    pieces: _containers.RepeatedCompositeFieldContainer[Piece]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., pieces: _Optional[_Iterable[_Union[Piece, _Mapping]]] = ...) -> None: ...

class Catalog(_message.Message):
    __slots__ = ("canonical", "tensors", "partial")
    CANONICAL_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    canonical: _containers.RepeatedCompositeFieldContainer[CanonicalTensor]
    tensors: _containers.RepeatedCompositeFieldContainer[LocalTensor]
    partial: bool
    def __init__(self, canonical: _Optional[_Iterable[_Union[CanonicalTensor, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[LocalTensor, _Mapping]]] = ..., partial: _Optional[bool] = ...) -> None: ...

class AdapterSpec(_message.Message):
    __slots__ = ("name", "rank", "alpha", "target_modules")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class LoraSlots(_message.Message):
    __slots__ = ("max_rank", "max_loras", "dtype")
    MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    max_rank: int
    max_loras: int
    dtype: str
    def __init__(self, max_rank: _Optional[int] = ..., max_loras: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class TransferUnit(_message.Message):
    __slots__ = ("canonical", "canon", "dtype", "src_tensor", "src_box", "dst_tensor", "dst_box", "nbytes", "quantized", "block_box", "src_dtype")
    CANONICAL_FIELD_NUMBER: _ClassVar[int]
    CANON_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SRC_TENSOR_FIELD_NUMBER: _ClassVar[int]
    SRC_BOX_FIELD_NUMBER: _ClassVar[int]
    DST_TENSOR_FIELD_NUMBER: _ClassVar[int]
    DST_BOX_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    QUANTIZED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BOX_FIELD_NUMBER: _ClassVar[int]
    SRC_DTYPE_FIELD_NUMBER: _ClassVar[int]
    canonical: str
    canon: Box
    dtype: str
    src_tensor: str
    src_box: Box
    dst_tensor: str
    dst_box: Box
    nbytes: int
    quantized: str
    block_box: Box
    src_dtype: str
    def __init__(self, canonical: _Optional[str] = ..., canon: _Optional[_Union[Box, _Mapping]] = ..., dtype: _Optional[str] = ..., src_tensor: _Optional[str] = ..., src_box: _Optional[_Union[Box, _Mapping]] = ..., dst_tensor: _Optional[str] = ..., dst_box: _Optional[_Union[Box, _Mapping]] = ..., nbytes: _Optional[int] = ..., quantized: _Optional[str] = ..., block_box: _Optional[_Union[Box, _Mapping]] = ..., src_dtype: _Optional[str] = ...) -> None: ...

class Relay(_message.Message):
    __slots__ = ("origin", "forwards_src", "forwards_dst", "forwards_index")
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_SRC_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_DST_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_INDEX_FIELD_NUMBER: _ClassVar[int]
    origin: str
    forwards_src: str
    forwards_dst: str
    forwards_index: int
    def __init__(self, origin: _Optional[str] = ..., forwards_src: _Optional[str] = ..., forwards_dst: _Optional[str] = ..., forwards_index: _Optional[int] = ...) -> None: ...

class Bucket(_message.Message):
    __slots__ = ("stage", "src", "dst", "index", "units", "nbytes", "relay")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    stage: int
    src: str
    dst: str
    index: int
    units: _containers.RepeatedCompositeFieldContainer[TransferUnit]
    nbytes: int
    relay: Relay
    def __init__(self, stage: _Optional[int] = ..., src: _Optional[str] = ..., dst: _Optional[str] = ..., index: _Optional[int] = ..., units: _Optional[_Iterable[_Union[TransferUnit, _Mapping]]] = ..., nbytes: _Optional[int] = ..., relay: _Optional[_Union[Relay, _Mapping]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("role", "member_id", "coords", "device", "data_address", "catalog_hash", "catalog", "run_id", "weight_version", "receive_by_layer", "host_id", "gpu_id", "gpu_peers", "adapter", "lora_slots")
    class CoordsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    COORDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CATALOG_HASH_FIELD_NUMBER: _ClassVar[int]
    CATALOG_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_BY_LAYER_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_PEERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    role: Role
    member_id: str
    coords: _containers.ScalarMap[str, int]
    device: str
    data_address: str
    catalog_hash: str
    catalog: Catalog
    run_id: str
    weight_version: int
    receive_by_layer: bool
    host_id: str
    gpu_id: str
    gpu_peers: _containers.RepeatedScalarFieldContainer[str]
    adapter: AdapterSpec
    lora_slots: LoraSlots
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., member_id: _Optional[str] = ..., coords: _Optional[_Mapping[str, int]] = ..., device: _Optional[str] = ..., data_address: _Optional[str] = ..., catalog_hash: _Optional[str] = ..., catalog: _Optional[_Union[Catalog, _Mapping]] = ..., run_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., receive_by_layer: _Optional[bool] = ..., host_id: _Optional[str] = ..., gpu_id: _Optional[str] = ..., gpu_peers: _Optional[_Iterable[str]] = ..., adapter: _Optional[_Union[AdapterSpec, _Mapping]] = ..., lora_slots: _Optional[_Union[LoraSlots, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("catalog_required", "session_id", "lease_seconds", "committed_version")
    CATALOG_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    catalog_required: bool
    session_id: str
    lease_seconds: float
    committed_version: int
    def __init__(self, catalog_required: _Optional[bool] = ..., session_id: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., committed_version: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("member_id", "session_id")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    session_id: str
    def __init__(self, member_id: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_seconds", "committed_version")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    committed_version: int
    def __init__(self, lease_seconds: _Optional[float] = ..., committed_version: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("member_id", "session_id")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    session_id: str
    def __init__(self, member_id: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("member_id", "session_id")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    session_id: str
    def __init__(self, member_id: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class StageGroup(_message.Message):
    __slots__ = ("stage", "group_id", "backend", "members")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    group_id: str
    backend: str
    members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stage: _Optional[int] = ..., group_id: _Optional[str] = ..., backend: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinGroup(_message.Message):
    __slots__ = ("refit_id", "group_id", "stage", "rank", "world_size", "backend", "address", "members", "timeout_s", "links")
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    refit_id: str
    group_id: str
    stage: int
    rank: int
    world_size: int
    backend: str
    address: str
    members: _containers.RepeatedScalarFieldContainer[str]
    timeout_s: float
    links: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, refit_id: _Optional[str] = ..., group_id: _Optional[str] = ..., stage: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., address: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., timeout_s: _Optional[float] = ..., links: _Optional[_Iterable[str]] = ...) -> None: ...

class ExecutePlan(_message.Message):
    __slots__ = ("refit_id", "weight_version", "buckets", "groups", "timeout_s", "delta", "stall_timeout_s", "ipc_links", "adapter")
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    STALL_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    IPC_LINKS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    refit_id: str
    weight_version: int
    buckets: _containers.RepeatedCompositeFieldContainer[Bucket]
    groups: _containers.RepeatedCompositeFieldContainer[StageGroup]
    timeout_s: float
    delta: DeltaLinks
    stall_timeout_s: float
    ipc_links: _containers.RepeatedCompositeFieldContainer[LinkRef]
    adapter: AdapterSpec
    def __init__(self, refit_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., buckets: _Optional[_Iterable[_Union[Bucket, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[StageGroup, _Mapping]]] = ..., timeout_s: _Optional[float] = ..., delta: _Optional[_Union[DeltaLinks, _Mapping]] = ..., stall_timeout_s: _Optional[float] = ..., ipc_links: _Optional[_Iterable[_Union[LinkRef, _Mapping]]] = ..., adapter: _Optional[_Union[AdapterSpec, _Mapping]] = ...) -> None: ...

class LinkRef(_message.Message):
    __slots__ = ("stage", "src", "dst")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    stage: int
    src: str
    dst: str
    def __init__(self, stage: _Optional[int] = ..., src: _Optional[str] = ..., dst: _Optional[str] = ...) -> None: ...

class DeltaLinks(_message.Message):
    __slots__ = ("base", "dsts", "max_fraction")
    BASE_FIELD_NUMBER: _ClassVar[int]
    DSTS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRACTION_FIELD_NUMBER: _ClassVar[int]
    base: int
    dsts: _containers.RepeatedScalarFieldContainer[str]
    max_fraction: float
    def __init__(self, base: _Optional[int] = ..., dsts: _Optional[_Iterable[str]] = ..., max_fraction: _Optional[float] = ...) -> None: ...

class Verify(_message.Message):
    __slots__ = ("refit_id", "weight_version", "timeout_s")
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    refit_id: str
    weight_version: int
    timeout_s: float
    def __init__(self, refit_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("refit_id", "weight_version", "timeout_s", "run_id", "adapter")
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    refit_id: str
    weight_version: int
    timeout_s: float
    run_id: str
    adapter: str
    def __init__(self, refit_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., timeout_s: _Optional[float] = ..., run_id: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("refit_id", "reason")
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    refit_id: str
    reason: str
    def __init__(self, refit_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("join_group", "execute_plan", "verify", "commit", "abort")
    JOIN_GROUP_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_PLAN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    join_group: JoinGroup
    execute_plan: ExecutePlan
    verify: Verify
    commit: Commit
    abort: Abort
    def __init__(self, join_group: _Optional[_Union[JoinGroup, _Mapping]] = ..., execute_plan: _Optional[_Union[ExecutePlan, _Mapping]] = ..., verify: _Optional[_Union[Verify, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("member_id", "session_id", "refit_id", "phase", "ok", "error", "bytes", "checksums", "timings", "address", "weight_version", "delta_elements", "changed_elements")
    class ChecksumsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class TimingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTA_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    session_id: str
    refit_id: str
    phase: Phase
    ok: bool
    error: str
    bytes: int
    checksums: _containers.ScalarMap[str, str]
    timings: _containers.ScalarMap[str, float]
    address: str
    weight_version: int
    delta_elements: int
    changed_elements: int
    def __init__(self, member_id: _Optional[str] = ..., session_id: _Optional[str] = ..., refit_id: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., bytes: _Optional[int] = ..., checksums: _Optional[_Mapping[str, str]] = ..., timings: _Optional[_Mapping[str, float]] = ..., address: _Optional[str] = ..., weight_version: _Optional[int] = ..., delta_elements: _Optional[int] = ..., changed_elements: _Optional[int] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LinkProgress(_message.Message):
    __slots__ = ("stage", "src", "bytes")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    stage: int
    src: str
    bytes: int
    def __init__(self, stage: _Optional[int] = ..., src: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class ProgressRequest(_message.Message):
    __slots__ = ("member_id", "session_id", "refit_id", "links")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    session_id: str
    refit_id: str
    links: _containers.RepeatedCompositeFieldContainer[LinkProgress]
    def __init__(self, member_id: _Optional[str] = ..., session_id: _Optional[str] = ..., refit_id: _Optional[str] = ..., links: _Optional[_Iterable[_Union[LinkProgress, _Mapping]]] = ...) -> None: ...

class ProgressResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VersionStatusRequest(_message.Message):
    __slots__ = ("member_id", "session_id", "weight_version")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    session_id: str
    weight_version: int
    def __init__(self, member_id: _Optional[str] = ..., session_id: _Optional[str] = ..., weight_version: _Optional[int] = ...) -> None: ...

class VersionStatusResponse(_message.Message):
    __slots__ = ("refit_id", "weight_version", "state", "ended", "error", "unconfirmed", "seconds", "bytes", "waiting_for")
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    UNCONFIRMED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    refit_id: str
    weight_version: int
    state: str
    ended: bool
    error: str
    unconfirmed: _containers.RepeatedScalarFieldContainer[str]
    seconds: float
    bytes: int
    waiting_for: str
    def __init__(self, refit_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., state: _Optional[str] = ..., ended: _Optional[bool] = ..., error: _Optional[str] = ..., unconfirmed: _Optional[_Iterable[str]] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., waiting_for: _Optional[str] = ...) -> None: ...
