"""Pure catalog builder: how each vLLM parameter is cut out of the canonical (HF) tensors.

A `ParamSpec` describes one vLLM parameter in checkpoint format (the layout vLLM's weight loaders
write, before any kernel repacking): its name, shape, dtype and how it is sharded over tensor
parallelism. `build_catalog(specs)` turns the specs into a syncd `Catalog` with the layout language.
Nothing here imports vLLM; `generator_svc.worker.vllm_layout` reads the specs off a live model.

Shape legend: `H` hidden, `I` MoE intermediate, `E` experts, `V` vocab, `D` head dim.

Vocab padding: vLLM pads the vocab of `VocabParallelEmbedding`/`ParallelLMHead` so every rank holds
`V_pad / tp` rows; a rank's shard is `[real rows | padded rows]`. Padded rows belong to no canonical
tensor, so the catalog registers only the leading real rows (`[V_local, H]`, a contiguous prefix of
the parameter) and vLLM's own loader keeps the padded rows at zero. A rank holding no real rows
is a configuration error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from syncd.layout import (
    Box,
    Canon,
    CanonicalTensor,
    Catalog,
    Concat,
    LocalTensor,
    Piece,
    Shard,
    Sharded,
    local_tensor,
)
from syncd.layout.placements import Expr


@dataclass(frozen=True)
class TP:
    """A tensor-parallel group position."""

    size: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} is outside a group of size {self.size}")


@dataclass(frozen=True)
class ReplicatedParam:
    """A parameter every rank holds whole (norms, the MoE router)."""

    name: str
    dtype: str
    canonical: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardedParam:
    """`ColumnParallelLinear` (dim 0) or `RowParallelLinear` (dim 1) of one canonical tensor."""

    name: str
    dtype: str
    canonical: str
    full_shape: tuple[int, ...]
    dim: int
    tp: TP


@dataclass(frozen=True)
class QKVParam:
    """`QKVParallelLinear`: `[q heads | k heads | v heads]` of this rank, each `[heads*D, H]`.
    With fewer kv heads than ranks, `tp.size // total_kv_heads` ranks share (replicate) a kv head."""

    name: str
    dtype: str
    q: str
    k: str
    v: str
    hidden: int
    head_dim: int
    total_heads: int
    total_kv_heads: int
    tp: TP


@dataclass(frozen=True)
class MergedParam:
    """`MergedColumnParallelLinear` (dense `gate_up_proj`): each part sharded on dim 0, concatenated."""

    name: str
    dtype: str
    parts: tuple[tuple[str, tuple[int, ...]], ...]
    tp: TP


@dataclass(frozen=True)
class VocabParam:
    """`VocabParallelEmbedding`/`ParallelLMHead`: real rows `[start, stop)` of the canonical `[V, H]`."""

    name: str
    dtype: str
    canonical: str
    full_shape: tuple[int, int]
    start: int
    stop: int


@dataclass(frozen=True)
class ExpertsParam:
    """Fused MoE experts of one layer. `w13 [E, 2I/tp, H]` holds per expert `[gate slice; up slice]`;
    `w2 [E, H, I/tp]`. `prefix` names the canonical grouped tensors (`{prefix}.gate_proj.weight`).
    With vLLM's expert parallelism a rank holds the experts `local_experts` = (first, count) whole
    (E above is then that count); without it, all `num_experts`."""

    name: str
    dtype: str
    kind: str  # "w13" or "w2"
    prefix: str
    num_experts: int
    intermediate: int
    hidden: int
    tp: TP
    local_experts: tuple[int, int] | None = None  # (first, count); None: all of them


ParamSpec = ReplicatedParam | ShardedParam | QKVParam | MergedParam | VocabParam | ExpertsParam


def _tp_shard(expr: Expr, dim: int, tp: TP) -> Expr:
    return Sharded(expr, (Shard(dim),), (tp.size,), (tp.rank,))


def _qkv_expr(p: QKVParam) -> Expr:
    if p.total_heads % p.tp.size:
        raise ValueError(f"{p.name}: {p.total_heads} query heads do not split over tp={p.tp.size}")
    q = _tp_shard(Canon(p.q, (p.total_heads * p.head_dim, p.hidden)), 0, p.tp)
    if p.total_kv_heads >= p.tp.size:
        if p.total_kv_heads % p.tp.size:
            raise ValueError(f"{p.name}: {p.total_kv_heads} kv heads do not split over tp={p.tp.size}")
        mesh, coord = p.tp.size, p.tp.rank
    else:
        if p.tp.size % p.total_kv_heads:
            raise ValueError(f"{p.name}: tp={p.tp.size} is not a multiple of {p.total_kv_heads} kv heads")
        # vLLM replicates each kv head on tp/kv consecutive ranks: rank r holds head r // replicas.
        mesh, coord = p.total_kv_heads, p.tp.rank // (p.tp.size // p.total_kv_heads)
    kv_shape = (p.total_kv_heads * p.head_dim, p.hidden)
    k = Sharded(Canon(p.k, kv_shape), (Shard(0),), (mesh,), (coord,))
    v = Sharded(Canon(p.v, kv_shape), (Shard(0),), (mesh,), (coord,))
    return Concat(0, (q, k, v))


def _experts_expr(p: ExpertsParam) -> Expr:
    if p.intermediate % p.tp.size:
        raise ValueError(f"{p.name}: intermediate size {p.intermediate} does not split over tp={p.tp.size}")
    E, I, H = p.num_experts, p.intermediate, p.hidden
    first, count = p.local_experts or (0, E)
    if not (first >= 0 and count > 0 and first + count <= E):
        raise ValueError(
            f"{p.name}: local experts {first}..{first + count - 1} are not within the {E} experts"
        )

    def held(name: str, shape: tuple[int, ...]) -> Canon:  # this rank's experts (all but under EP)
        box = Box((first, *(0 for _ in shape[1:])), (first + count, *shape[1:]))
        return Canon(name, shape, box)

    if p.kind == "w13":
        gate = _tp_shard(held(f"{p.prefix}.gate_proj.weight", (E, I, H)), 1, p.tp)
        up = _tp_shard(held(f"{p.prefix}.up_proj.weight", (E, I, H)), 1, p.tp)
        return Concat(1, (gate, up))
    if p.kind == "w2":
        return _tp_shard(held(f"{p.prefix}.down_proj.weight", (E, H, I)), 2, p.tp)
    raise ValueError(f"{p.name}: unknown experts kind {p.kind!r}; expected 'w13' or 'w2'")


def param_expr(p: ParamSpec) -> Expr:
    """The layout expression of one parameter (its boxes of canonical tensors)."""
    if isinstance(p, ReplicatedParam):
        return Canon(p.canonical, p.shape)
    if isinstance(p, ShardedParam):
        if p.full_shape[p.dim] % p.tp.size:
            raise ValueError(f"{p.name}: dim {p.dim} of {p.full_shape} does not split over tp={p.tp.size}")
        return _tp_shard(Canon(p.canonical, p.full_shape), p.dim, p.tp)
    if isinstance(p, QKVParam):
        return _qkv_expr(p)
    if isinstance(p, MergedParam):
        return Concat(0, tuple(_tp_shard(Canon(n, s), 0, p.tp) for n, s in p.parts))
    if isinstance(p, VocabParam):
        if p.stop <= p.start:
            raise ValueError(f"{p.name}: this rank holds no real vocab rows ([{p.start}, {p.stop}))")
        box = Box((p.start, 0), (p.stop, p.full_shape[1]))
        return Canon(p.canonical, p.full_shape, box)
    if isinstance(p, ExpertsParam):
        return _experts_expr(p)
    raise TypeError(f"unknown parameter spec {type(p).__name__}")


def _canonical_shapes(p: ParamSpec) -> dict[str, tuple[int, ...]]:
    def walk(e: Expr) -> dict[str, tuple[int, ...]]:
        if isinstance(e, Canon):
            return {e.name: e.canonical_shape}
        if isinstance(e, Concat):
            return {k: v for part in e.parts for k, v in walk(part).items()}
        if isinstance(e, Sharded):
            return walk(e.expr)
        raise TypeError(type(e).__name__)

    return walk(param_expr(p))


def build_catalog(
    specs: list[ParamSpec], *, expected_shapes: dict[str, tuple[int, ...]] | None = None
) -> Catalog:
    """One worker's catalog: a local tensor per parameter, in spec order.

    `expected_shapes` (parameter name -> checkpoint-format shape, as vLLM allocated it) cross-checks
    the layout; a parameter whose computed shape differs raises ValueError naming it.
    """
    canonical: dict[str, CanonicalTensor] = {}
    tensors: list[LocalTensor] = []
    for p in specs:
        t = local_tensor(p.name, p.dtype, param_expr(p))
        if expected_shapes is not None and p.name in expected_shapes:
            want = tuple(expected_shapes[p.name])
            if isinstance(p, VocabParam):
                want = (p.stop - p.start, *want[1:])  # the real-row prefix of a padded shard
            if t.shape != want:
                raise ValueError(f"parameter {p.name}: layout gives shape {t.shape}, vLLM allocated {want}")
        for name, shape in _canonical_shapes(p).items():
            prior = canonical.setdefault(name, CanonicalTensor(name, shape, p.dtype))
            if prior.shape != shape or prior.dtype != p.dtype:
                raise ValueError(f"canonical tensor {name} declared as {prior} and {shape}/{p.dtype}")
        tensors.append(t)
    catalog = Catalog(tuple(canonical.values()), tuple(tensors))
    catalog.validate()
    return catalog


def catalog_to_json(catalog: Catalog) -> str:
    """A catalog as JSON (collective_rpc and HTTP carry plain data, not dataclasses)."""
    return json.dumps(
        {
            "canonical": [[c.name, list(c.shape), c.dtype] for c in catalog.canonical],
            "tensors": [
                [
                    t.name,
                    list(t.shape),
                    t.dtype,
                    [
                        [p.canonical, p.canon.start, p.canon.stop, p.local.start, p.local.stop]
                        for p in t.pieces
                    ],
                ]
                for t in catalog.tensors
            ],
        }
    )


def catalog_from_json(text: str) -> Catalog:
    doc = json.loads(text)
    canonical = tuple(CanonicalTensor(n, tuple(s), d) for n, s, d in doc["canonical"])
    tensors = tuple(
        LocalTensor(
            n,
            tuple(s),
            d,
            tuple(
                Piece(c, Box(tuple(cs), tuple(ce)), Box(tuple(ls), tuple(le))) for c, cs, ce, ls, le in pieces
            ),
        )
        for n, s, d, pieces in doc["tensors"]
    )
    return Catalog(canonical, tensors)
