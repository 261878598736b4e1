"""Fixtures of the DTensor attach tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def kv4_model(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE with 4 kv heads, so attention splits over tp 4 in whole heads."""
    from trainer_svc.config import ModelArgs
    from trainer_svc.tiny import TINY_ARGS, make_tiny_checkpoint

    args = ModelArgs(**{**TINY_ARGS.__dict__, "num_key_value_heads": 4})
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kv4"), seed=0, args=args)
