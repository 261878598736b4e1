"""The copy-engine anchor for same-host transfers: GPU 0 -> GPU 1 copies (cudaMemcpyPeerAsync, which
torch issues for a cross-device `copy_` when peer access is on) of the same bytes the refit
benchmark moves, timed with CUDA events. Prints GB/s per chunk size; --json writes them.

Usage: python3 bench/peer_copy_anchor.py [--gib 8] [--chunk-mib 64,256,512] [--reps 5] [--json F]
"""

import argparse
import json
import statistics

import torch

_MIB = 1 << 20


def _time_copies(src: torch.Tensor, dst: torch.Tensor, chunk: int, stream: torch.cuda.Stream) -> float:
    """Seconds to copy all of `src` into `dst` in `chunk`-byte pieces on one stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for offset in range(0, src.numel(), chunk):
            dst[offset : offset + chunk].copy_(src[offset : offset + chunk], non_blocking=True)
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--chunk-mib", default="64,256,512")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs")
    nbytes = int(args.gib * (1 << 30))
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0").random_()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    peer = torch.cuda.can_device_access_peer(0, 1)
    stream = torch.cuda.Stream(device="cuda:1")  # the receiving side pulls, as the transport will
    results = {"device": torch.cuda.get_device_name(0), "peer_access": peer, "gib": args.gib, "gbps": {}}
    with torch.cuda.device(1):
        for chunk_mib in (int(c) for c in args.chunk_mib.split(",")):
            _time_copies(src, dst, chunk_mib * _MIB, stream)  # warm-up
            times = [_time_copies(src, dst, chunk_mib * _MIB, stream) for _ in range(args.reps)]
            gbps = nbytes / statistics.median(times) / 1e9
            results["gbps"][str(chunk_mib)] = round(gbps, 1)
            print(f"peer copy GPU0->GPU1 chunk {chunk_mib} MiB: {gbps:.1f} GB/s (peer access {peer})")
    assert torch.equal(src[:_MIB].cpu(), dst[:_MIB].cpu())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
