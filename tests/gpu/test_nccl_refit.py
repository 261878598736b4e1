"""GPU data plane: a refit from a trainer rank on GPU 0 into a receiver on GPU 1 whose tensors are
shaped like vLLM's parameters (qkv_proj, w13, w2, ...), through nccl4py; every byte checked."""

from __future__ import annotations

import datetime
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from syncd.net import free_port

pytestmark = pytest.mark.gpu(count=2)


def _worker(rank: int, port: int, result_dir: str) -> None:
    from syncd.member.dataplane import LoopOptions, catalog_views, recv_buckets, send_buckets
    from syncd.member.dataplane.nccl import NcclTransport
    from syncd.plan import DestMember, SourceMember, make_plan
    from syncd.plan.simulate import materialize
    from testkit.synthetic_moe import trainer_catalog, vllm_catalog
    from tests.gpu.small_moe import SMALL_MOE
    from tests.gpu.small_moe import canonical as small_moe_weights

    torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    src_cat, dst_cat = trainer_catalog(SMALL_MOE, 1, 0, 1, 0), vllm_catalog(SMALL_MOE, 2, 1)
    plan = make_plan(
        [SourceMember("trainer-0", 0, src_cat)], [DestMember("generator-0-1", dst_cat)], bucket_bytes=1 << 20
    )
    canonical = small_moe_weights(7)
    catalog = src_cat if rank == 0 else dst_cat
    if rank == 0:
        owned = {k: torch.from_numpy(v).to(device) for k, v in materialize(src_cat, canonical).items()}
    else:
        owned = {t.name: torch.full(t.shape, float("nan"), device=device) for t in dst_cat.tensors}
    box = [NcclTransport.create_address() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    transport = NcclTransport.connect(box[0], rank, 2, device, timeout_s=60)
    ranks = {"trainer-0": 0, "generator-0-1": 1}
    views = catalog_views(catalog, owned)
    run = send_buckets if rank == 0 else recv_buckets
    stats = run(
        plan.for_member("trainer-0" if rank == 0 else "generator-0-1"),
        views,
        transport,
        ranks,
        LoopOptions(60),
    )
    sums = [None, None]
    dist.all_gather_object(sums, stats.checksums)
    if rank == 1:
        expected = materialize(dst_cat, canonical)
        bad = [n for n, t in owned.items() if not np.array_equal(t.cpu().numpy(), expected[n])]
        names = sorted(owned)
        ok = not bad and sums[0] == sums[1] and len(sums[0]) == plan.num_units
        with open(os.path.join(result_dir, "result.txt"), "w") as f:
            f.write(f"ok={ok} bad={bad} tensors={names}\n")
    transport.close()
    dist.destroy_process_group()


def test_nccl_refit_into_vllm_shaped_tensors_is_bit_exact(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    result = (tmp_path / "result.txt").read_text()
    assert result.startswith("ok=True"), result
    assert "qkv_proj" in result and "w13_weight" in result and "w2_weight" in result


@pytest.mark.gpu(count=1)
def test_gpu_checksums_equal_the_same_algorithm_on_cpu():
    """The device reductions (wrapping int32 sums, batched int64 folds) give the values the
    algorithm defines, which the CPU run of the same code computes."""
    from syncd.member.dataplane.checksum import DeviceSums

    gen = torch.Generator().manual_seed(5)
    regions = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        for n in (5, 4096, 4096 * 300 + 17, 1 << 22, 0, 4096 * 1000)
    ]
    regions[-1].fill_(255)
    on_cpu, on_gpu = DeviceSums(), DeviceSums()
    for r in regions:
        on_cpu.add(r)
        on_gpu.add(r.cuda())
    assert on_gpu.values() == on_cpu.values()


@pytest.mark.gpu(count=4)
def test_per_stage_nccl_groups_pp2_into_tp2_are_bit_exact(tmp_path):
    """Two trainer stages (GPUs 0-1) into a TP=2 receiver (GPUs 2-3), one communicator per stage,
    stages concurrent and serialized (bench/stage_bench.py, small model)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "stage.json"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [
            sys.executable,
            "bench/stage_bench.py",
            "--backend",
            "nccl",
            "--gib",
            "0.05",
            "--bucket-mib",
            "8",
            "--reps",
            "1",
            "--json",
            str(out),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["bit_exact"] and result["checksums_ok"], result
