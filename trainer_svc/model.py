"""Qwen3-MoE with Hugging Face parameter names and local (sharded) parameter shapes.

Shape legend: B batch, S sequence, H hidden, D head dim, N_l local query heads (heads / tp),
G_l local kv heads, V vocab.

One `Qwen3MoeStage` is one pipeline stage: the embedding on the first stage, its slice of the
decoder layers (keyed by their global index, so parameter names are the HF names), and the final
norm and lm_head on the last. Parameters are created empty; `shard_cut.load_into` fills them.
The numerics follow transformers' Qwen3MoeForCausalLM (float32 RMSNorm, rotate-half RoPE).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer_svc import comm
from trainer_svc.config import ModelArgs
from trainer_svc.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(seq_len: int, args: ModelArgs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, D] of the default RoPE."""
    D = args.head_dim
    inv_freq = 1.0 / (
        args.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D)
    )
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """GQA attention; q/k/v column-parallel and o_proj row-parallel over tp."""

    def __init__(self, args: ModelArgs, tp_group: comm.Group) -> None:
        super().__init__()
        tp = comm.group_size(tp_group)
        self.tp_group = tp_group
        self.head_dim = args.head_dim
        self.heads = args.num_attention_heads // tp
        self.kv_heads = args.num_key_value_heads // tp
        H, D = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(H, self.heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, args.rms_norm_eps)
        self.k_norm = RMSNorm(D, args.rms_norm_eps)

    def forward(self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        x_BSH = comm.copy_to_tp(x_BSH, self.tp_group)
        q = self.q_norm(self.q_proj(x_BSH).view(B, S, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x_BSH).view(B, S, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BSH).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos_SD + _rotate_half(q) * sin_SD
        k = k * cos_SD + _rotate_half(k) * sin_SD
        groups = self.heads // self.kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(B, S, self.heads * self.head_dim)
        return comm.reduce_from_tp(self.o_proj(o), self.tp_group)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, ep_group: comm.Group, tp_group: comm.Group) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, tp_group)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MoE(args, ep_group, tp_group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    """The `model.` prefix of HF's parameter names; a stage holds the parts it runs."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleDict
    norm: RMSNorm


class Qwen3MoeStage(nn.Module):
    """One pipeline stage. First stage takes token ids [B, S]; others take hidden [B, S, H].
    The last stage returns logits [B, S, V]; others return hidden [B, S, H]."""

    def __init__(
        self,
        args: ModelArgs,
        layer_ids: range,
        *,
        first: bool,
        last: bool,
        ep_group: comm.Group = None,
        tp_group: comm.Group = None,
    ) -> None:
        super().__init__()
        self.args = args
        self.layer_ids = layer_ids
        self.first, self.last = first, last
        self.model = _Body()
        if first:
            self.model.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.model.layers = nn.ModuleDict({str(i): DecoderLayer(args, ep_group, tp_group) for i in layer_ids})
        if last:
            self.model.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.first else x
        cos, sin = (t.to(h.dtype) for t in rope_cos_sin(h.shape[1], self.args, h.device))
        for layer in self.model.layers.values():
            h = layer(h, cos, sin)
        if self.last:
            h = self.lm_head(self.model.norm(h))
        return h
