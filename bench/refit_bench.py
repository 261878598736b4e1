"""Refit benchmark: one trainer rank (expert-TP layout) -> one generator worker (vLLM layout).

    python bench/refit_bench.py --backend gloo --gib 0.25         # CPU (two processes)
    python bench/refit_bench.py --backend nccl --gib 8 --json OUT  # two GPUs

Measured in one run, on the same bytes:
  (a) raw:        one large buffer through the transport (the limit)
  (b) refit:      this project's plan + bucketed, double-buffered transfer with checksums
  (c) per-tensor: one broadcast per HF tensor, copied into vLLM's layout (what many RL
                  frameworks do)
  (d) gather+bcast: HF tensors packed into buckets and broadcast from one rank after gathering
                  the model there (with one trainer rank the gather is free), then unpacked
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.synthetic_moe import MoeShape, trainer_catalog, vllm_catalog  # noqa: E402
from syncd.dataplane import GlooTransport, catalog_views, recv_buckets, send_buckets  # noqa: E402
from syncd.dataplane.pack import TORCH_DTYPES  # noqa: E402
from syncd.layout.hf_names import is_grouped_expert, split_to_hf  # noqa: E402
from syncd.plan import DestMember, SourceMember, make_plan  # noqa: E402


def shape_for(gib: float) -> MoeShape:
    """A Qwen3-30B-A3B-like layer (128 experts, hidden 2048, expert dim 768); layers to fit `gib`."""
    base = MoeShape(layers=1, hidden=2048, experts=128, moe_inter=768, heads=32, kv_heads=4, vocab=32768)
    per_layer = sum(c.nbytes for c in base.canonical()) - 2 * base.vocab * base.hidden * 2
    layers = max(1, round(gib * 2**30 / per_layer))
    if gib < 1:  # CPU-sized runs: shrink the experts instead of the layer count
        base = MoeShape(layers=4, hidden=512, experts=32, moe_inter=256, heads=8, kv_heads=2, head_dim=64, vocab=8192)
        per_layer = sum(c.nbytes for c in base.canonical()) / base.layers
        layers = max(1, round(gib * 2**30 / per_layer))
    return MoeShape(**{**base.__dict__, "layers": layers})


def hf_regions(shape: MoeShape, catalog, views):
    """(HF name, tensor) pairs as the trainer would produce them from its local layout, without
    copies: views into its tensors."""
    pieces = {}
    for t in catalog.tensors:
        for p in t.pieces:
            region = views[t.name][tuple(slice(a, b) for a, b in zip(p.local.start, p.local.stop))]
            pieces[p.canonical] = region.reshape(p.canon.shape)
    out = []
    for name, tensor in pieces.items():
        out += split_to_hf(name, tensor, shape.experts) if is_grouped_expert(name) else [(name, tensor)]
    return out


def _timed(fn, device, reps: int) -> float:
    times = []
    for _ in range(reps + 1):  # first run warms up
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(rank: int, args, port: int, out_path: str) -> None:
    backend = args.backend
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    shape = shape_for(args.gib)
    src_cat, dst_cat = trainer_catalog(shape, 1, 0, 1, 0), vllm_catalog(shape, 1, 0)
    plan = make_plan([SourceMember("trainer-0", 0, src_cat)], [DestMember("generator-0-0", dst_cat)],
                     bucket_bytes=args.bucket_mib << 20)
    ranks = {"trainer-0": 0, "generator-0-0": 1}
    catalog = src_cat if rank == 0 else dst_cat
    gen = torch.Generator(device=device).manual_seed(0)
    owned = {t.name: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=device) for t in catalog.tensors}
    for t in owned.values():
        t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32)) if rank == 0 else t.zero_()
    views = catalog_views(catalog, owned)
    transport = _our_transport(backend, rank, device)
    total = plan.total_bytes
    result: dict = {"bytes": total, "buckets": len(plan.buckets), "units": plan.num_units,
                    "hf_tensors": shape.hf_tensor_count(), "canonical_tensors": len(shape.canonical())}

    raw = torch.empty(total, dtype=torch.uint8, device=device)
    result["raw_seconds"] = _timed(lambda: (transport.isend(raw, 1) if rank == 0 else transport.irecv(raw, 0)).wait(300), device, args.reps)
    del raw

    stats = {}
    base_mem = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def refit(verify: bool = True):
        run = send_buckets if rank == 0 else recv_buckets
        stats["last"] = run(plan.for_member("trainer-0" if rank == 0 else "generator-0-0"), views, transport, ranks,
                            timeout_s=300, verify=verify, in_flight=args.in_flight)

    result["refit_noverify_seconds"] = _timed(lambda: refit(verify=False), device, args.reps)
    result["refit_seconds"] = _timed(refit, device, args.reps)
    if device.type == "cuda":
        result["extra_gpu_mib"] = (torch.cuda.max_memory_allocated(device) - base_mem) / 2**20
    gathered = [None, None]
    dist.all_gather_object(gathered, stats["last"].checksums)
    result["checksums_ok"] = gathered[0] == gathered[1] and len(gathered[0]) == plan.num_units

    hf = hf_regions(shape, src_cat, views) if rank == 0 else hf_regions(shape, dst_cat, views)
    result["per_tensor_seconds"] = _timed(lambda: _per_tensor(hf, rank), device, args.reps)
    result["gather_bcast_seconds"] = _timed(lambda: _bucketed_bcast(hf, rank, args.bucket_mib << 20, device), device, args.reps)
    transport.close()
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


def _our_transport(backend: str, rank: int, device):
    box = [None]
    if backend == "nccl":
        from syncd.dataplane.nccl import NcclTransport

        if rank == 0:
            box[0] = NcclTransport.create_address()
        dist.broadcast_object_list(box, src=0)
        return NcclTransport.connect(box[0], rank, 2, device, 120)
    store = None
    if rank == 0:
        box[0], store = GlooTransport.create_address("127.0.0.1", 2, 120)
    dist.broadcast_object_list(box, src=0)
    return GlooTransport.connect(box[0], rank, 2, "bench", 300, store)


def _per_tensor(hf, rank: int) -> None:
    """Baseline (c): a broadcast per HF tensor; the receiver copies each into vLLM's layout."""
    for _, region in hf:
        if rank == 0:
            dist.broadcast(region.contiguous(), src=0)
        else:
            tmp = torch.empty(region.shape, dtype=region.dtype, device=region.device)
            dist.broadcast(tmp, src=0)
            region.copy_(tmp)


def _bucketed_bcast(hf, rank: int, bucket_bytes: int, device) -> None:
    """Baseline (d): HF tensors packed into buckets, broadcast, unpacked into vLLM's layout."""
    buf = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    batch, size = [], 0
    for item in hf + [None]:
        nbytes = item[1].numel() * item[1].element_size() if item else 0
        if batch and (item is None or size + nbytes > bucket_bytes):
            offset = 0
            for _, region in batch:
                n = region.numel() * region.element_size()
                if rank == 0:
                    buf[offset : offset + n].view(region.dtype).view(region.shape).copy_(region)
                offset += n
            dist.broadcast(buf[:offset], src=0)
            if rank == 1:
                offset = 0
                for _, region in batch:
                    n = region.numel() * region.element_size()
                    region.copy_(buf[offset : offset + n].view(region.dtype).view(region.shape))
                    offset += n
            batch, size = [], 0
        if item is not None:
            if nbytes > bucket_bytes:  # a tensor larger than a bucket goes alone
                buf = torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes > buf.numel() else buf
            batch.append(item)
            size += nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--gib", type=float, default=0.25, help="model size to move")
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--in-flight", type=int, default=2, help="staging buffers per side")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"refit_bench_{os.getpid()}.json"
    mp.spawn(worker, args=(args, port, str(out)), nprocs=2, join=True)
    r = json.loads(out.read_text())
    out.unlink()
    gb = r["bytes"] / 1e9
    rows = [("raw (one buffer)", r["raw_seconds"]), ("refit (this project)", r["refit_seconds"]),
            ("refit without checksums", r["refit_noverify_seconds"]),
            ("per-tensor broadcast", r["per_tensor_seconds"]), ("gather + bucketed broadcast", r["gather_bcast_seconds"])]
    print(f"{args.backend}: {gb:.2f} GB, {r['hf_tensors']} HF tensors ({r['canonical_tensors']} canonical), "
          f"{r['units']} units in {r['buckets']} buckets of <= {args.bucket_mib} MiB, checksums ok: {r['checksums_ok']}")
    print(f"{'method':<30} {'seconds':>9} {'GB/s':>8} {'vs raw':>7}")
    for name, sec in rows:
        print(f"{name:<30} {sec:>9.4f} {gb / sec:>8.2f} {r['raw_seconds'] / sec:>7.2f}")
    summary = {
        "backend": args.backend,
        "bytes": r["bytes"],
        "raw_gbps": round(gb / r["raw_seconds"], 3),
        "refit_gbps": round(gb / r["refit_seconds"], 3),
        "per_tensor_gbps": round(gb / r["per_tensor_seconds"], 3),
        "gather_bcast_gbps": round(gb / r["gather_bcast_seconds"], 3),
        "refit_noverify_gbps": round(gb / r["refit_noverify_seconds"], 3),
        "refit_vs_raw": round(r["raw_seconds"] / r["refit_seconds"], 3),
        "refit_vs_per_tensor": round(r["per_tensor_seconds"] / r["refit_seconds"], 3),
        "refit_vs_gather_bcast": round(r["gather_bcast_seconds"] / r["refit_seconds"], 3),
        "checksums_ok": r["checksums_ok"],
        "extra_gpu_mib": round(r.get("extra_gpu_mib", 0.0), 1),
        "hf_tensors": r["hf_tensors"],
        "bucket_mib": args.bucket_mib,
        "in_flight": args.in_flight,
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(0) if args.backend == "nccl" else f"CPU ({os.cpu_count()} cores)",
    }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
