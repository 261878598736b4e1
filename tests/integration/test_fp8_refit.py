"""Blockwise-FP8 refits through a real syncd over gRPC and gloo: bfloat16 trainer ranks with the
trainer's own catalogs, layouts (1,2,2) and (2,2,1), send e4m3 weights and float32 block scales,
quantized while packing, to generator ranks holding vLLM's FP8 parameter layout (fused qkv and
w13, TP 1 and 2) for a model whose hidden size (200) is not a multiple of 128. What lands equals,
byte for byte, a block-by-block quantizer written here applied to the trainer's weights.

vLLM CPU cannot build a blockwise-FP8 model on this machine (2026-11-24, `bench/fp8_cpu_probe.py`
in git history), so the receiving ranks are member-library endpoints with plain tensors
(`testkit/endpoints.py`)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from generator_svc.worker.catalog import (
    TP,
    ExpertsParam,
    QKVParam,
    ReplicatedParam,
    ShardedParam,
    VocabParam,
    build_catalog,
)
from syncd.daemon.service import Daemon
from syncd.member.agent import AgentSettings, MemberAgent
from syncd.member.client import MemberClient
from syncd.plan.fp8_blocks import blockwise_fp8_catalog
from syncd.plan.simulate import materialize
from syncd.refit_wait import wait_final
from testkit.endpoints import GeneratorEndpoint, TrainerEndpoint
from tests.fp8_reference import checkpoint_arrays
from tests.syncd_settings import syncd_settings
from trainer_svc import catalog as trainer_catalog
from trainer_svc.canonical import canonical_shapes
from trainer_svc.config import ModelArgs
from trainer_svc.parallel_dims import ParallelDims

ARGS = ModelArgs(
    vocab_size=300,
    hidden_size=200,
    moe_intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    num_experts=4,
    num_experts_per_tok=2,
)


def vllm_specs(args: ModelArgs, tp: TP, dtype: str = "bfloat16") -> list:
    """The parameters of a vLLM Qwen3-MoE rank, as `generator_svc.worker.vllm_layout` reads them off a
    live model (vocab split evenly: padding is not what this test is about)."""
    H, V, D, E, I = (
        args.hidden_size,
        args.vocab_size,
        args.head_dim,
        args.num_experts,
        args.moe_intermediate_size,
    )
    rows = (tp.rank * V // tp.size, (tp.rank + 1) * V // tp.size)
    specs: list = [VocabParam("model.embed_tokens.weight", dtype, "model.embed_tokens.weight", (V, H), *rows)]
    for layer in range(args.num_hidden_layers):
        p = f"model.layers.{layer}"
        attn = f"{p}.self_attn"
        specs += [
            ReplicatedParam(f"{p}.input_layernorm.weight", dtype, f"{p}.input_layernorm.weight", (H,)),
            QKVParam(
                f"{attn}.qkv_proj.weight",
                dtype,
                f"{attn}.q_proj.weight",
                f"{attn}.k_proj.weight",
                f"{attn}.v_proj.weight",
                H,
                D,
                args.num_attention_heads,
                args.num_key_value_heads,
                tp,
            ),
            ShardedParam(
                f"{attn}.o_proj.weight",
                dtype,
                f"{attn}.o_proj.weight",
                (H, args.num_attention_heads * D),
                1,
                tp,
            ),
            ReplicatedParam(f"{attn}.q_norm.weight", dtype, f"{attn}.q_norm.weight", (D,)),
            ReplicatedParam(f"{attn}.k_norm.weight", dtype, f"{attn}.k_norm.weight", (D,)),
            ReplicatedParam(
                f"{p}.post_attention_layernorm.weight", dtype, f"{p}.post_attention_layernorm.weight", (H,)
            ),
            ReplicatedParam(f"{p}.mlp.gate.weight", dtype, f"{p}.mlp.gate.weight", (E, H)),
            ExpertsParam(f"{p}.mlp.experts.w13_weight", dtype, "w13", f"{p}.mlp.experts", E, I, H, tp),
            ExpertsParam(f"{p}.mlp.experts.w2_weight", dtype, "w2", f"{p}.mlp.experts", E, I, H, tp),
        ]
    specs += [
        ReplicatedParam("model.norm.weight", dtype, "model.norm.weight", (H,)),
        VocabParam("lm_head.weight", dtype, "lm_head.weight", (V, H), *rows),
    ]
    return specs


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    bits = {torch.float8_e4m3fn: torch.uint8, torch.bfloat16: torch.int16}.get(t.dtype)
    return (t if bits is None else t.view(bits)).numpy()


@pytest.fixture
def start(tmp_path: Path):
    running: list = []

    def start_cluster(layout: tuple[int, int, int], generator_tp: int, delta: bool = False):
        pp, ep, tp = layout
        dims = ParallelDims(pp=pp, ep=ep, tp=tp)
        settings = syncd_settings(
            tmp_path,
            bucket_bytes=64 << 10,
            expected_trainers=dims.world_size,
            expected_generators=generator_tp,
            delta_refits=delta,
        )
        daemon = Daemon(settings)
        daemon.start()
        running.append(daemon)
        target = f"127.0.0.1:{daemon.grpc_port}"
        trainers = [
            TrainerEndpoint(trainer_catalog.build_catalog(ARGS, dims, c, "bfloat16"))
            for c in dims.all_coords()
        ]
        generators = [
            GeneratorEndpoint(blockwise_fp8_catalog(build_catalog(vllm_specs(ARGS, TP(generator_tp, r)))))
            for r in range(generator_tp)
        ]
        members = [
            (
                MemberClient(
                    target,
                    role="trainer",
                    member_id=f"trainer-{dims.rank_of(c)}",
                    coords=c.as_dict(),
                    catalog=t.catalog,
                ),
                t,
            )
            for c, t in zip(dims.all_coords(), trainers)
        ]
        members += [
            (
                MemberClient(
                    target,
                    role="generator",
                    member_id=f"generator-0-{r}",
                    coords={"replica": 0, "tp": r},
                    catalog=g.catalog,
                ),
                g,
            )
            for r, g in enumerate(generators)
        ]
        for client, holder in members:
            agent = MemberAgent(client, holder, AgentSettings())
            client.start(agent)
            running.extend((client, agent))
        http = httpx.Client(base_url=f"http://127.0.0.1:{settings.http_port}", timeout=30)
        running.append(http)
        deadline = time.monotonic() + 30
        while not http.get("/readyz").json()["ready"]:
            assert time.monotonic() < deadline, http.get("/readyz").json()
            time.sleep(0.1)
        return http, members[0][0].announce_version, trainers, generators

    yield start_cluster
    for thing in reversed(running):
        (thing.stop if isinstance(thing, Daemon) else thing.close)()


@pytest.mark.parametrize(
    "layout, generator_tp, delta",
    [((1, 2, 2), 1, False), ((1, 2, 2), 2, False), ((2, 2, 1), 2, False), ((1, 2, 2), 2, True)],
    ids=[
        "pp1-ep2-tp2-into-tp1",
        "pp1-ep2-tp2-into-tp2",
        "pp2-ep2-tp1-into-tp2",
        "pp1-ep2-tp2-into-tp2-delta-refits-on",
    ],
)
def test_fp8_generators_receive_the_reference_quantization_of_the_trainers_bfloat16_weights(
    start, layout, generator_tp, delta
):
    """With delta refits on, the second refit is planned as a delta; its buckets go dense (FP8 ones
    always: the quantizer runs on whole blocks; here every weight is new as well)."""
    http, announce, trainers, generators = start(layout, generator_tp, delta)
    gen = torch.Generator().manual_seed(0)
    for version in (1, 2):  # the second refit quantizes the trainers' new weights
        weights = {
            n: (torch.randn(s, generator=gen) * (0.02 if len(s) > 1 else 1)).to(torch.bfloat16)
            for n, s in canonical_shapes(ARGS).items()
        }
        for trainer in trainers:
            trainer.load({n: x.view(torch.int16).numpy() for n, x in weights.items()})
        announce(version)
        r = http.post("/v1/refits", json={"weight_version": version})
        assert r.status_code == 202, r.text
        state = wait_final(lambda path: http.get(path).json(), r.json()["id"], 120, poll_s=0.05)
        assert state["state"] == "COMMITTED", state
        assert state["mode"] == ("delta" if delta and version == 2 else "full"), state
        expected = checkpoint_arrays(weights)
        for rank, generator in enumerate(generators):
            assert generator.version == version
            for name, want in materialize(generator.catalog, expected).items():
                np.testing.assert_array_equal(
                    _as_numpy(generator.params[name]), want, err_msg=f"rank {rank} {name}"
                )
