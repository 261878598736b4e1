"""Collectives with autograd, over one process group each.

Convention (Megatron-style): an activation "replicated over tp" is held whole and identical by
every TP rank, and so is its gradient. Each function below states its backward so that this
invariant holds; a group of None (or of size 1) makes every function the identity.

gloo has no reduce_scatter and needs equal all_gather sizes, so variable-size gathers pad to the
largest block and reduce-scatters are an all_reduce followed by keeping one's own block: the same
result, and the same code runs on NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_gather_rows(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    """Concatenate every rank's `x` (rank r holds `sizes[r]` rows) along dim 0, without autograd."""
    if group_size(group) == 1:
        return x
    width = max(sizes)
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    blocks = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(blocks, padded.contiguous(), group=group)
    return torch.cat([b[:n] for b, n in zip(blocks, sizes)])


def _my_block(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    r = group_rank(group)
    start = sum(sizes[:r])
    return x[start : start + sizes[r]]


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group_size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    """Replicated input entering a column-parallel op: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Partial sums of a row-parallel op: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SplitRows(torch.autograd.Function):
    """Replicated input, keep my block of rows; backward all-gathers the blocks' gradients."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _my_block(x, sizes, group).clone()

    @staticmethod
    def backward(ctx, grad):
        return all_gather_rows(grad.contiguous(), ctx.sizes, ctx.group), None, None


class _GatherRowsReplicated(torch.autograd.Function):
    """All-gather into a replicated output; its gradient is whole on every rank, keep my block."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return all_gather_rows(x.contiguous(), sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _my_block(grad, ctx.sizes, ctx.group).contiguous(), None, None


class _GatherRowsForShardedUse(torch.autograd.Function):
    """All-gather rows that feed TP-sharded weights: every rank's gradient is a partial sum, so
    the backward is a reduce-scatter."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return all_gather_rows(x.contiguous(), sizes, group)

    @staticmethod
    def backward(ctx, grad):
        full = _all_reduce(grad.contiguous().clone(), ctx.group)
        return _my_block(full, ctx.sizes, ctx.group).contiguous(), None, None


class _ReduceScatterRows(torch.autograd.Function):
    """Partial sums of all ranks' rows: sum them and keep my block; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        full = _all_reduce(x.contiguous().clone(), group)
        return _my_block(full, sizes, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather_rows(grad.contiguous(), ctx.sizes, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    """Rows sent in blocks of `send` sizes, received in blocks of `recv` sizes; backward reverses."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return all_to_all_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_rows(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group: Group) -> torch.Tensor:
    """all_to_all_single over dim 0 without autograd."""
    if group_size(group) == 1:
        return x.clone()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def split_rows(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _SplitRows.apply(x, sizes, group)


def gather_rows_replicated(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherRowsReplicated.apply(x, sizes, group)


def gather_rows_for_sharded_use(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherRowsForShardedUse.apply(x, sizes, group)


def reduce_scatter_rows(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceScatterRows.apply(x, sizes, group)


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _AllToAll.apply(x, send, recv, group)


def all_gather_sizes(n: int, group: Group, device: torch.device) -> list[int]:
    """Every rank's integer `n`, in group rank order."""
    if group_size(group) == 1:
        return [n]
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(group_size(group))]
    dist.all_gather(out, mine, group=group)
    return [int(t.item()) for t in out]
