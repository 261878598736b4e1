"""What an export in a given dtype stores for each HF tensor: the tensor cast to that dtype
(rounded to nearest even where narrower), or under `FP8_EXPORT` a quantized weight's e4m3 values
and its block scales. Shared by the gathered export (`hf_checkpoint.save_hf`) and the
rank-parallel one (`parallel_export.py`), so both write the same bytes.
"""

from __future__ import annotations

import torch

from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane.fp8 import quantize_blockwise
from syncd.plan.fp8_blocks import FP8_DTYPE, SCALE_DTYPE, is_quantized, scale_name, scale_shape
from trainer_svc.config import FP8_EXPORT, FP8_UNQUANTIZED_DTYPE, unquantized_dtype


def stored_entries(
    hf_name: str, shape: tuple[int, ...], dtype: str
) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of each tensor that an export in `dtype` (a dtype name, or
    FP8_EXPORT) stores for HF tensor `hf_name` of `shape`: the tensor, and under FP8_EXPORT the
    block scales of a quantized one."""
    if dtype == FP8_EXPORT and is_quantized(hf_name):
        return [(hf_name, FP8_DTYPE, shape), (scale_name(hf_name), SCALE_DTYPE, scale_shape(shape))]
    return [(hf_name, unquantized_dtype(dtype), shape)]


def stored_tensors(hf_name: str, t: torch.Tensor, dtype: str) -> list[tuple[str, torch.Tensor]]:
    """The CPU tensors named as `stored_entries` lists them, from HF tensor `hf_name`'s value `t`:
    cast (rounded to nearest even where narrower), or quantized blockwise."""
    if dtype == FP8_EXPORT and is_quantized(hf_name):
        # Quantized from the bfloat16 value, as the FP8 checkpoints are derived from the bf16 weights
        # the model computes with; from float32 masters a block could round to other e4m3 values.
        fp8, scale_inv = quantize_blockwise(t.detach().to(torch_dtype(FP8_UNQUANTIZED_DTYPE)))
        return [(hf_name, fp8.cpu()), (scale_name(hf_name), scale_inv.cpu())]
    return [(hf_name, t.detach().to("cpu", torch_dtype(unquantized_dtype(dtype))).contiguous())]
