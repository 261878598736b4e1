"""The GPU checksum kernel's speed on contiguous bytes, by variant and program size, against a
device-to-device copy of the same bytes (one GPU).

    python -m bench.checksum_kernel_probe [--gib 4] [--rounds 9] [--json PATH]

`checksum_kernel.reduce_batch` over `--gib` of contiguous memory cut into 512 MiB regions, with
rows of a region read as runs of whole rows (one start per row) or by the general long-runs
addressing (two candidate starts per item), at several rows per program (fewer column-sum
atomics against fewer programs to spread), and the torch form (two reductions, `reduce_region`).
GB/s of the bytes checked; a copy's GB/s counts the bytes copied (read once, written once).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.landed_gpu_bench import gpu_timed, landed_model
from syncd.member.dataplane import checksum_kernel
from syncd.member.dataplane.checksum import reduce_region, region_outputs
from syncd.member.dataplane.landed import landed_checksums


def _same_sums(a: checksum_kernel.ReducedRegions, b: checksum_kernel.ReducedRegions) -> bool:
    return torch.equal(a.cols, b.cols) and torch.equal(a.weighted_rows, b.weighted_rows)


def _model_units(rounds: int) -> dict[str, object]:
    """Where the landed check's time goes on `landed_gpu_bench`'s model: the kernels alone per
    variant, all regions in one batch, and the whole check with its fold and read-back."""
    units, _, views = landed_model(8, 64, 512)
    maybe = [checksum_kernel.describe(views[u.dst_tensor][u.dst_box.slices()]) for u in units]
    regions = [r for r in maybe if r is not None]
    assert len(regions) == len(units)
    total = sum(r.numel for r in regions)
    out: dict[str, object] = {"units": len(units), "bytes": total}
    by_variant: dict[tuple, list[checksum_kernel.Region]] = {}
    for r in regions:
        by_variant.setdefault(r.variant, []).append(r)
    for variant, members in by_variant.items():
        n = sum(r.numel for r in members)
        s = gpu_timed(lambda members=members: checksum_kernel.reduce_batch(members), rounds)
        dims = sorted({r.dims for r in members})[:4]
        out[str(variant)] = {"regions": len(members), "bytes": n, "gbps": round(n / s / 1e9, 1), "dims": dims}
    s = gpu_timed(lambda: checksum_kernel.reduce_batch(regions), rounds)
    out["kernels_gbps"] = round(total / s / 1e9, 1)
    s = gpu_timed(lambda: landed_checksums(units, views), rounds)
    out["landed_check_gbps"] = round(total / s / 1e9, 1)
    return out


def _copy_sweep(src: torch.Tensor, dst: torch.Tensor, step: int, rounds: int) -> dict[str, object]:
    """The copy in the checksum kernel's pass (`describe_copy`) by tile, warps and rows per
    program, on contiguous 512 MiB regions and on the colocated probe's units (trainer layout
    into vLLM's, strided where they differ); the sums checked against the in-place kernel's."""
    from bench.colocated_gpu_probe import unit_pairs

    pairs = unit_pairs(4)
    nbytes = src.numel()
    contiguous = [(dst[i : i + step], src[i : i + step]) for i in range(0, nbytes, step)]
    out: dict[str, object] = {"model_bytes": sum(d.nbytes for d, _ in pairs), "model_units": len(pairs)}
    for name, cases in (("contiguous", contiguous), ("model", pairs)):
        total = sum(d.nbytes for d, _ in cases)
        reference = checksum_kernel.reduce_batch([checksum_kernel.describe(s) for _, s in cases])
        out[f"{name}_variants"] = sorted({str(checksum_kernel.describe_copy(d, s).variant) for d, s in cases})
        for tile in (2048, 4096):
            for warps in (4, 8):
                for per_program in (16, 32, 64, 128):
                    checksum_kernel._COPY_ELEMENTS_PER_TILE = tile
                    checksum_kernel._NUM_WARPS = warps
                    checksum_kernel._ROWS_PER_PROGRAM = per_program
                    regions = [checksum_kernel.describe_copy(d, s) for d, s in cases]
                    for d, _ in cases:
                        d.fill_(0)
                    got = checksum_kernel.reduce_batch(regions)
                    same = _same_sums(got, reference)
                    same = same and all(torch.equal(d, s) for d, s in cases)
                    s = gpu_timed(lambda regions=regions: checksum_kernel.reduce_batch(regions), rounds)
                    out[f"{name}_t{tile}_w{warps}_r{per_program}"] = [round(total / s / 1e9, 1), same]
    checksum_kernel._COPY_ELEMENTS_PER_TILE, checksum_kernel._NUM_WARPS = 4096, 8
    checksum_kernel._ROWS_PER_PROGRAM = 64
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", default="")
    ap.add_argument("--copy-sweep", action="store_true", help="only the copy variant's sweep")
    args = ap.parse_args()
    nbytes = int(args.gib * (1 << 30)) // (1 << 20) * (1 << 20)
    src = torch.randint(-128, 127, (nbytes,), dtype=torch.int8, device="cuda").view(torch.uint8)
    dst = torch.empty_like(src)
    step = 512 << 20
    regions = [checksum_kernel.describe(src[i : i + step]) for i in range(0, nbytes, step)]
    described = [r for r in regions if r is not None]
    assert len(described) == len(regions)
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "bytes": nbytes}
    copy_s = gpu_timed(lambda: dst.copy_(src), args.rounds)
    result["d2d_gbps"] = round(nbytes / copy_s / 1e9, 1)
    if args.copy_sweep:
        result["copy_sweep"] = _copy_sweep(src, dst, step, args.rounds)
        print(json.dumps(result, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return
    reference = checksum_kernel.reduce_batch(described)
    for whole_rows in (False, True):
        for per_program in (64, 256, 1024):
            checksum_kernel._ROWS_PER_PROGRAM = per_program

            def run(whole_rows: bool = whole_rows) -> checksum_kernel.ReducedRegions:
                return checksum_kernel.reduce_batch(described, whole_rows)

            out = run()
            same = _same_sums(out, reference)
            s = gpu_timed(run, args.rounds)
            key = f"kernel_{'whole_rows' if whole_rows else 'long_runs'}_{per_program}rows"
            result[key + "_gbps"] = round(nbytes / s / 1e9, 1)
            result[key + "_over_d2d_speed"] = round(copy_s / s, 3)
            result[key + "_same_sums"] = same

    def torch_form() -> None:
        for i in range(0, nbytes, step):
            reduce_region(src[i : i + step], *region_outputs(step, src.device))

    s = gpu_timed(torch_form, args.rounds)
    result["torch_form_gbps"] = round(nbytes / s / 1e9, 1)
    checksum_kernel._ROWS_PER_PROGRAM = 64
    result["model_units"] = _model_units(args.rounds)
    result["date"] = time.strftime("%Y-%m-%d")
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
