"""Pure planning of Muon's communication: which path a batch of matrices takes and which rank
orthogonalizes which matrix. No torch.distributed here; `muon_comm.py` executes the plans.

A *batch* is a set of matrices whose pieces sit on the same *work group* of G = tp x replicas
ranks: every matrix is cut into `tp` equal pieces along one dim (rank (r, t) holds piece t of every
matrix of the batch), and each of the `replicas` holds identical pieces (dp copies of the experts,
dp x ep copies of attention). Group rank g = r * tp + t, which is the order of the sorted global
ranks (the mesh is tp-minor). Batches are, per layer: q/k/v (split on rows), o_proj (on columns),
the experts' gate and up matrices (2 E_l, rows), and their down matrices (E_l, columns).

Paths, by divisibility of the batch's M matrices and G ranks (checked in this order):
- `local`: G == 1, or tp == 1 with G a multiple of M: whole matrices are already here, and
  sharing M matrices over more replicas than matrices would not shorten the step.
- `all_to_all`: M a multiple of G: each matrix's pieces go to one owner (M / G matrices per rank,
  dp replicas included, so they share the work), which orthogonalizes it and sends every rank its
  piece back.
- `all_gather`: G a multiple of M (fewer matrices than ranks, e.g. one o_proj): one all-gather over
  tp gives every rank the whole matrices, each orthogonalizes all M and keeps its piece; one round
  of communication instead of two, for M times the NS work of the all-to-all.
- `batched`: neither divides (e.g. q, k, v: 3 matrices on 2 or 4 ranks): the all-to-all with
  owners assigned round robin, so owners hold ceil or floor of M / G matrices; uneven splits, so no
  matrix is padded with zeros to fill a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

LOCAL, ALL_GATHER, ALL_TO_ALL, BATCHED = "local", "all_gather", "all_to_all", "batched"
PATHS = (LOCAL, ALL_GATHER, ALL_TO_ALL, BATCHED)


@dataclass(frozen=True)
class BatchLayout:
    """How one batch of matrices is spread over its work group."""

    shapes: tuple[tuple[int, int], ...]  # the whole (global) shape of every matrix
    shard_dim: int  # the matrix dim cut into tp pieces (0 rows, 1 columns)
    tp: int
    replicas: int

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("a Muon batch needs at least one matrix")
        if self.shard_dim not in (0, 1):
            raise ValueError(f"shard_dim must be 0 or 1, got {self.shard_dim}")
        if self.tp < 1 or self.replicas < 1:
            raise ValueError(f"tp and replicas must be >= 1, got tp {self.tp}, replicas {self.replicas}")
        for shape in self.shapes:
            if shape[self.shard_dim] % self.tp:
                raise ValueError(
                    f"matrix shape {shape} dim {self.shard_dim} is not divisible by tp {self.tp}"
                )

    @property
    def matrices(self) -> int:
        return len(self.shapes)

    @property
    def group_size(self) -> int:
        return self.tp * self.replicas

    def piece_shape(self, m: int) -> tuple[int, int]:
        rows, cols = self.shapes[m]
        return (rows // self.tp, cols) if self.shard_dim == 0 else (rows, cols // self.tp)

    def piece_numel(self, m: int) -> int:
        rows, cols = self.piece_shape(m)
        return rows * cols


def choose_path(layout: BatchLayout) -> str:
    m, g = layout.matrices, layout.group_size
    if g == 1 or (layout.tp == 1 and g % m == 0):
        return LOCAL
    if m % g == 0:
        return ALL_TO_ALL
    if g % m == 0:
        return ALL_GATHER
    return BATCHED


def owners(layout: BatchLayout) -> tuple[int, ...]:
    """The group rank that orthogonalizes each matrix (all-to-all paths): round robin, so every
    rank owns floor or ceil of M / G matrices and replicas share the work."""
    return tuple(m % layout.group_size for m in range(layout.matrices))


Item = tuple[int, int]  # (matrix index, piece index)


@dataclass(frozen=True)
class Exchange:
    """One rank's side of one all-to-all over the work group: what it sends to and receives from
    every group rank, in buffer order (by matrix index on both sides, so the two sides agree)."""

    send: tuple[tuple[Item, ...], ...]  # send[dst]
    recv: tuple[tuple[Item, ...], ...]  # recv[src]


def _exchange(transfers: list[tuple[int, int, int, int]], group_size: int, me: int) -> Exchange:
    """Rank `me`'s view of (src, dst, matrix, piece) transfers, listed in matrix order."""
    send: list[list[Item]] = [[] for _ in range(group_size)]
    recv: list[list[Item]] = [[] for _ in range(group_size)]
    for src, dst, m, piece in sorted(transfers, key=lambda t: (t[2], t[3])):
        if src == me:
            send[dst].append((m, piece))
        if dst == me:
            recv[src].append((m, piece))
    return Exchange(tuple(map(tuple, send)), tuple(map(tuple, recv)))


def gather_to_owners(layout: BatchLayout, me: int) -> Exchange:
    """Every piece of a matrix to its owner, from the tp row of the owner's own replica (the other
    replicas hold the same values and send nothing)."""
    transfers: list[tuple[int, int, int, int]] = []
    for m, owner in enumerate(owners(layout)):
        replica = owner // layout.tp
        transfers.extend((replica * layout.tp + t, owner, m, t) for t in range(layout.tp))
    return _exchange(transfers, layout.group_size, me)


def scatter_from_owners(layout: BatchLayout, me: int) -> Exchange:
    """Every rank of the work group gets its piece (its tp index) of every orthogonalized matrix."""
    transfers: list[tuple[int, int, int, int]] = []
    for m, owner in enumerate(owners(layout)):
        transfers.extend((owner, dst, m, dst % layout.tp) for dst in range(layout.group_size))
    return _exchange(transfers, layout.group_size, me)
