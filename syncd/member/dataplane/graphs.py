"""CUDA graphs of one loop's per-bucket work, captured on the first refit and replayed after.

Why: with small buckets the loops are host-bound. Each bucket costs the host a Python call and a
launch per unit to pack (or unpack) and two reductions and a few stream calls per unit to
checksum, about 0.1-0.3 ms; a 64 MiB transfer over NVLink takes 0.19 ms, so the wire idles
(bench/reports/2026-11-23-data-plane-host-work.md, loop-back profile). A plan is fixed between
refits and so are the tensors and the staging buffers, so the work of a bucket in a staging slot
is the same kernels on the same addresses every time: captured once, it costs one graph launch
per step.

Per bucket and slot, a `BucketProgram` holds two graphs, because they run on two streams: the
copies (pack or unpack, on the loop's work stream) and the checksum reductions (on the checksum
stream, overlapping the next transfer). The reductions write into outputs the program owns;
`checksum` hands them to `DeviceSums` exactly as eager reductions would be, so the values (and
syncd's comparison per unit) are the same as without graphs.

Off by default (`graphs=False` in the loops' options): on one H100 (the loop-back benchmark,
2026-11-23) they cut host launches per bucket and side from 14.6 / 9.4 / 5.6 to 3.1 / 2.6 / 2.2 at
512 / 256 / 64 MiB buckets and the host time of pack and checksum by 2.5x, but the refit ran
slower (111 against 204 GB/s at 512 MiB, 39 against 44 at 64 MiB;
bench/reports/2026-11-23-data-plane-host-work.md). Whether they
pay between two GPUs is open: `bench/refit_bench.py --graphs` measures it.

Lifecycle: `LoopGraphs` belongs to one direction of one transport (kept with its staging
buffers). A program is keyed by its bucket object, its staging slot and the addresses of every
tensor it touches, so a new plan, a new staging buffer or a reallocated parameter captures anew;
`retain_used` drops the programs that the last refit did not use, so the cache stays one plan's
worth.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from syncd.commands import checksum_key
from syncd.member.dataplane.checksum import Checksums, reduce_region, region_outputs
from syncd.member.dataplane.pack import pack_into, unpack_from
from syncd.plan.types import Bucket
from syncd.vocabulary import Direction


class BucketProgram:
    """The captured copies and checksums of one bucket in one staging slot."""

    direct = None  # always through staging (see `prepared.PreparedBucket.direct`)

    def __init__(
        self,
        bucket: Bucket,
        copy_graph: torch.cuda.CUDAGraph,
        sums_graph: torch.cuda.CUDAGraph,
        outputs: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> None:
        self.bucket = bucket  # held, so that the id in the cache key stays this bucket's
        self._copy_graph, self._sums_graph = copy_graph, sums_graph
        self._keys = [checksum_key(u.canonical, u.canon) for u in bucket.units]
        self._outputs = outputs

    def copy(self) -> None:
        """Pack or unpack the bucket, on the current stream."""
        self._copy_graph.replay()

    def checksum(self, sums: Checksums) -> None:
        """Reduce every unit of the packed or arrived bucket on the current stream and hand the
        results to `sums`."""
        self._sums_graph.replay()
        for key, (numel, cols, rows, rest) in zip(self._keys, self._outputs):
            sums.add_reduced(key, numel, cols, rows, rest)


# Torch refuses to replay a graph while any thread of the process captures one ("Cannot prepare for
# replay during capturing stage"), and an eager stream wait from another thread during a capture
# failed too (cudaErrorInvalidValue; H100, torch 2.11, bench/loopback_bench.py: both sides of a
# loop-back in one process, as a generator receives from several stages at once). So while graphs
# are on, every loop enqueues under this lock and a capture holds it; nobody holds it across a wait.
ENQUEUE_LOCK = threading.RLock()


class LoopGraphs:
    """The programs of one loop (one direction of one transport), captured on a stream of their
    own, with one memory pool for the reductions' scratch space (the programs replay one after
    another on one stream, so they may share it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._capture_stream = torch.cuda.Stream(device)
        self._pool = torch.cuda.graph_pool_handle()
        self._programs: dict[tuple, BucketProgram] = {}
        self._used: set[tuple] = set()

    def programs(
        self,
        direction: Direction,
        buckets: Sequence[Bucket],
        tensors: Mapping[str, torch.Tensor],
        flats: Sequence[torch.Tensor],
    ) -> list[BucketProgram]:
        """The program of each bucket packed into (send) or unpacked from (recv) its staging
        slice in `flats`, capturing those not seen before. Capturing runs nothing: the caller
        replays them in order."""
        keys = [self._key(direction, b, tensors, f) for b, f in zip(buckets, flats)]
        missing = [i for i, k in enumerate(keys) if k not in self._programs]
        if missing:
            with ENQUEUE_LOCK:
                for i in missing:
                    self._programs[keys[i]] = self._capture(direction, buckets[i], tensors, flats[i])
        self._used.update(keys)
        return [self._programs[k] for k in keys]

    @staticmethod
    def _key(direction: Direction, bucket: Bucket, tensors, flat: torch.Tensor) -> tuple:
        names = [u.src_tensor if direction == Direction.SEND else u.dst_tensor for u in bucket.units]
        return (
            direction,
            id(bucket),
            flat.data_ptr(),
            flat.numel(),
            tuple(tensors[n].data_ptr() for n in names),
        )

    def retain_used(self) -> None:
        """Forget the programs the refit that just ended did not use (an older plan's)."""
        self._programs = {k: p for k, p in self._programs.items() if k in self._used}
        self._used = set()

    def _capture(self, direction: Direction, bucket: Bucket, tensors, flat: torch.Tensor) -> BucketProgram:
        def copy() -> None:
            if direction == Direction.SEND:
                pack_into(bucket, tensors, flat)
            else:
                unpack_from(bucket, flat, tensors)

        outputs = [(u.nbytes, *region_outputs(u.nbytes, self.device)) for u in bucket.units]

        def reduce_all() -> None:
            at = 0
            for numel, cols, rows, rest in outputs:
                reduce_region(flat[at : at + numel], cols, rows, rest)
                at += numel

        return BucketProgram(bucket, self._graph(copy), self._graph(reduce_all), outputs)

    def _graph(self, work: Callable[[], object]) -> torch.cuda.CUDAGraph:
        """Capture `work` without running it. Thread-local capture: the other loops of this
        process (other stages, or the other side of a loop-back) keep launching meanwhile.
        (Not `torch.cuda.graph(...)`: it synchronizes the device and empties the allocator's
        cache, which would stall those loops.)"""
        graph = torch.cuda.CUDAGraph()
        self._capture_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._capture_stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                work()
            finally:
                graph.capture_end()
        return graph
