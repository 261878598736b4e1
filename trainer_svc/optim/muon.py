"""Muon's math on whole matrices: Nesterov momentum, Newton-Schulz orthogonalization, update scale.

Muon replaces a hidden matrix's gradient step by the nearest semi-orthogonal matrix to its
(Nesterov) momentum, U V^T of its SVD U S V^T, approximated by a few iterations of an odd quintic
polynomial X <- a X + b (X X^T) X + c (X X^T)^2 X that pushes every singular value of the
Frobenius-normalised input towards 1 (towards roughly 0.7-1.2 with these coefficients, which
trade exactness for speed, as in the commonly used implementation).

Momentum is element-wise, so it runs on any shard; orthogonalization needs the whole matrix,
and so does the scale, which comes from the *global* shape (a tp shard's shape would give a
layout-dependent step). Communication to assemble whole matrices lives in `muon_comm.py`.
"""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# Matches the RMS of Muon's update to a typical AdamW update (about 0.2), so one learning rate and
# one weight decay serve both optimizers (the "Moonlight" scaling: 0.2 * sqrt(max(rows, cols))).
UPDATE_RMS = 0.2
NORM_EPS = 1e-7


def nesterov_momentum(grad: torch.Tensor, buf: torch.Tensor, momentum: float) -> torch.Tensor:
    """Update the momentum buffer in place (buf = momentum * buf + grad) and return the Nesterov
    look-ahead grad + momentum * buf, the matrix Muon orthogonalizes."""
    buf.mul_(momentum).add_(grad)
    return grad.add(buf, alpha=momentum)


@torch.no_grad()
def orthogonalize(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Approximately U V^T of a whole 2-D matrix `g`, by `steps` quintic Newton-Schulz iterations,
    in float32. The iteration runs on the wide orientation (rows <= cols) where X X^T is smaller."""
    if g.dim() != 2:
        raise ValueError(f"orthogonalize needs a 2-D matrix, got shape {tuple(g.shape)}")
    x = g.to(torch.float32)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.t()
    x = x / (x.norm() + NORM_EPS)
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.t()
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.t() if tall else x).to(g.dtype)


def update_scale(global_shape: tuple[int, ...]) -> float:
    """The factor on an orthogonalized update of a matrix whose whole (unsharded) shape is given."""
    return UPDATE_RMS * math.sqrt(max(global_shape))


def muon_update(momentum_matrix: torch.Tensor, steps: int) -> torch.Tensor:
    """The scaled update of one whole matrix (what the optimizer subtracts, times the learning rate)."""
    return orthogonalize(momentum_matrix, steps) * update_scale(tuple(momentum_matrix.shape))
