"""The trainer's optimizers: AdamW for everything, or Muon for the hidden matrices + AdamW for the rest.

Muon takes the attention projections (q, k, v, o) and every expert's gate, up and down matrices,
each orthogonalized on its own; AdamW keeps the embedding, the head, the norms and the router,
for which an orthogonalized step is not meant (vectors, or matrices whose rows are looked up or
compete in a softmax). Both use the same learning rate and decoupled weight decay: Muon's update
is scaled to AdamW's typical RMS (`muon.update_scale`).

Lifecycle: `build_optimizer` is collective (Muon creates its process groups); every rank then
calls `step()` after the gradients were summed over their replicas, so replicas hold identical
momenta and the work group can split the Newton-Schulz work among them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from trainer_svc.config import ModelArgs
from trainer_svc.optim.muon import nesterov_momentum
from trainer_svc.optim.muon_comm import Ranks, WorkGroups, group_ranks, orthogonalized_pieces
from trainer_svc.optim.muon_plan import BatchLayout, choose_path
from trainer_svc.parallel_dims import Mesh
from trainer_svc.settings import TrainSettings
from trainer_svc.sharding import sharding_of

log = logging.getLogger("trainer_svc.optim")
OPTIMIZERS = ("adamw", "muon")
EXPERT_SPAN, ATTENTION_SPAN = ("dp", "tp"), ("dp", "ep", "tp")


@dataclass(frozen=True)
class BatchKind:
    """Which batch a Muon parameter joins: per layer, q/k/v together, o_proj, experts' gate+up,
    experts' down; `span` is the mesh dims of its work group (tp and the dims it is replicated on)."""

    key: str  # the batch's name, e.g. "model.layers.0.self_attn.qkv"
    shard_dim: int  # the matrix dim cut over tp
    span: tuple[str, ...]


def batch_kind(name: str) -> BatchKind | None:
    """The batch of a parameter, or None for parameters AdamW updates: Muon's hidden matrices are
    exactly the parameters cut over tp (embedding, head, router and norms are replicated)."""
    s = sharding_of(name)
    if s.tp_dim is None:
        return None
    if s.ep_dim is not None:  # an expert's matrix is one slice of the expert dim
        return BatchKind(name, s.tp_dim - 1, EXPERT_SPAN)
    if s.tp_dim == 0:  # q, k and v of a layer, column-parallel alike
        return BatchKind(name.rsplit(".", 2)[0] + ".qkv", 0, ATTENTION_SPAN)
    return BatchKind(name, s.tp_dim, ATTENTION_SPAN)


def matrix_views(name: str, t: torch.Tensor, args: ModelArgs, tp: int) -> list[torch.Tensor]:
    """This rank's piece of every matrix in local tensor `t` of parameter `name`, as views.
    The fused gate/up weight [E_l*2*I_l, H] holds 2 E_l matrices [I_l, H] (gate_0, up_0, ...),
    down_proj [E_l, H, I_l] holds E_l; attention weights are one matrix each."""
    s = sharding_of(name)
    if len(s.fused) > 1:
        return list(t.view(-1, args.moe_intermediate_size // tp, t.shape[-1]).unbind(0))
    if s.ep_dim is not None:
        return list(t.unbind(0))
    return [t]


@dataclass
class MuonBatch:
    key: str
    params: list[tuple[str, torch.nn.Parameter]]
    layout: BatchLayout
    path: str
    ranks: Ranks  # the work group's global ranks
    me: int  # this rank's index in it


class MuonWithAdamW:
    """Muon (Nesterov momentum, Newton-Schulz, communication by `muon_plan` paths) + AdamW."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh, args: ModelArgs, settings: TrainSettings) -> None:
        self.args, self.mesh = args, mesh
        self.lr, self.weight_decay = settings.lr, settings.weight_decay
        self.momentum, self.ns_steps = settings.muon_momentum, settings.muon_ns_steps
        self.groups = WorkGroups(mesh.dims)
        self.tp_group = self.groups.get(group_ranks(mesh.dims, mesh.rank, ("tp",)))
        self.batches = self._plan_batches(model)
        muon_ids = {id(p) for b in self.batches for _, p in b.params}
        rest = [p for p in model.parameters() if id(p) not in muon_ids]
        self.adamw = torch.optim.AdamW(rest, lr=settings.lr, weight_decay=settings.weight_decay)
        self._momentum_bufs: dict[int, torch.Tensor] = {}
        self._log_paths()

    @property
    def paths(self) -> dict[str, str]:
        """Parameter name -> the communication path its matrices take."""
        return {name: b.path for b in self.batches for name, _ in b.params}

    def _plan_batches(self, model: torch.nn.Module) -> list[MuonBatch]:
        dims, tp = self.mesh.dims, self.mesh.dims.tp
        grouped: dict[str, tuple[BatchKind, list]] = {}
        for name, p in model.named_parameters():
            kind = batch_kind(name)
            if kind is not None:
                grouped.setdefault(kind.key, (kind, []))[1].append((name, p))
        batches = []
        for key, (kind, params) in grouped.items():
            ranks = group_ranks(dims, self.mesh.rank, kind.span)
            shapes = []
            for name, p in params:
                for piece in matrix_views(name, p.detach(), self.args, tp):
                    rows, cols = piece.shape
                    shapes.append((rows * tp, cols) if kind.shard_dim == 0 else (rows, cols * tp))
            layout = BatchLayout(tuple(shapes), kind.shard_dim, tp, len(ranks) // tp)
            me = ranks.index(self.mesh.rank)
            batches.append(MuonBatch(key, params, layout, choose_path(layout), ranks, me))
        return batches

    def _log_paths(self) -> None:
        c = self.mesh.coords
        if (c.dp, c.ep, c.tp) != (0, 0, 0):
            return  # one rank per pipeline stage tells
        for b in self.batches:
            names = ", ".join(n for n, _ in b.params)
            log.info(
                "muon path %s for %s (%d matrices over %d ranks, tp %d)",
                b.path,
                names,
                b.layout.matrices,
                b.layout.group_size,
                b.layout.tp,
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        for b in self.batches:
            for _, p in b.params:
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for b in self.batches:
            self._muon_step(b)
        self.adamw.step()

    def _muon_step(self, b: MuonBatch) -> None:
        updates, pieces = [], []
        for name, p in b.params:
            buf = self._momentum_bufs.setdefault(id(p), torch.zeros_like(p))
            assert p.grad is not None, f"{name} has no gradient"
            u = nesterov_momentum(p.grad, buf, self.momentum)
            updates.append(u)
            pieces += matrix_views(name, u, self.args, self.mesh.dims.tp)
        results = orthogonalized_pieces(
            pieces, b.layout, b.path, b.me, self.groups.get(b.ranks), self.tp_group, self.ns_steps
        )
        for view, result in zip(pieces, results):
            view.copy_(result)  # pieces are views of `updates`
        for (_, p), u in zip(b.params, updates):
            p.mul_(1 - self.lr * self.weight_decay).add_(u, alpha=-self.lr)


def build_optimizer(settings: TrainSettings, model: torch.nn.Module, mesh: Mesh, args: ModelArgs):
    """Collective when `settings.optimizer == "muon"` (creates Muon's process groups)."""
    if settings.optimizer == "adamw":
        trainable = [p for p in model.parameters() if p.requires_grad]  # a LoRA run: the adapters
        return torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=settings.weight_decay)
    return MuonWithAdamW(model, mesh, args, settings)
