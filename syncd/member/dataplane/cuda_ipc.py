"""Colocated data plane on GPUs: the receiver copies every unit straight out of the sender's tensors,
opened through CUDA IPC (on its own GPU, or on one it reads directly: peer access), with the
checksum of what it wrote taken in the same pass.

No staging and no packing on either side: a unit costs one read of the sender's bytes and one
write of the receiver's (`Checksums.add_copy`: on NVIDIA GPUs the checksum kernel writes each item
it reads), and the sender checksums its regions where they lie, on its own stream, just before
the receiver's copies (which wait for them on the GPU). Both report their checksums to syncd as
every link does, so the comparison stays end to end: what the sender holds against what landed.

The handshake of one refit (`IpcSender.send` / `IpcReceiver.receive`), over a `Channel`
(`local_channel`):
  1. the sender enqueues its checksums behind the writes of its weights, records an interprocess
     event behind them and posts "ready": its exports (`ipc_handles`: one handle per allocation
     its units read, with each tensor's place in it) and the event;
  2. the receiver maps the allocations it has not mapped yet, makes its stream wait for the event
     (on the GPU: no host round trip, and the copies start when the weights are final; two
     processes' kernels on one GPU take turns rather than share it, so running the sender's
     checksums first loses nothing), copies and checksums every unit, reads its sums back and
     posts "done" (or why not);
  3. the sender reports its checksums and waits for "done": only then may its weights change.

Lifetimes. The receiver keeps its mappings from refit to refit (a mapping costs a driver call and
page-table work) and unmaps an allocation when an offer no longer names it, and everything at
`close`, which every end of a refit that is not a commit calls (abort, failure) and the group's
end. The sender holds nothing for the receiver: it frees its weights as any memory, and the driver
frees an allocation once no process maps it, a killed process's mappings included. A peer killed
mid-refit fails the other at once where the channel sees its end (`TransferError`: a Unix socket
does), else after `timeout_s` (`TransferTimeout`), or when mapping its memory (`TransferError`).

Not for every unit: the copy moves bytes as they are, so a unit whose sender converts or quantizes
(`src_dtype`, `quantized`) cannot take it (`ipc_units_refusal` names the first); memory of expandable
segments cannot be exported through these handles (the driver refuses; `IpcSender` says so).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from syncd.commands import checksum_key
from syncd.member.dataplane import checksum_kernel, ipc_handles
from syncd.member.dataplane.checksum import Checksums
from syncd.member.dataplane.local_channel import Channel
from syncd.member.dataplane.transport import TransferError
from syncd.plan.transports import ipc_units_refusal
from syncd.plan.types import TransferUnit


def source_checksums(units: Sequence[TransferUnit], views: Mapping[str, torch.Tensor]) -> Checksums:
    """The sender's checksums of its units' regions where they lie (enqueued; `result()` reads them)."""
    sums = Checksums()
    for u in units:
        sums.add_region(checksum_key(u.canonical, u.canon), views[u.src_tensor][u.src_box.slices()])
    return sums


def copy_checksummed(
    units: Sequence[TransferUnit], views: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor]
) -> Checksums:
    """Every unit copied from the sender's tensors `theirs` into `views` with the checksum of
    what it wrote (enqueued; `result()` waits for the copies and reads the sums)."""
    sums = Checksums()
    for u in units:
        dst = views[u.dst_tensor][u.dst_box.slices()]
        src = theirs[u.src_tensor][u.src_box.slices()]
        sums.add_copy(checksum_key(u.canonical, u.canon), dst, _as_shape(src, dst.shape))
    return sums


class _Prepared:
    """The kernels of `source_checksums` or `copy_checksummed` prepared once for the refits that
    follow (`checksum_kernel.Batch`): describing and uploading 39 regions of a 4 GB model cost
    the host 1-2 ms a refit on an H100 machine, as long as the sender's checksums themselves.
    `key` says what they were built for: the units and where every tensor they touch lies."""

    def __init__(self) -> None:
        self._built: tuple[tuple, tuple[list[str], checksum_kernel.Batch] | None] | None = None

    def sums(self, key: tuple, build: Callable[[], Checksums], regions: Callable[[], list]) -> Checksums:
        """Checksums of the prepared batch for `key` (built now from `regions()` if it is new);
        `build()` where some region cannot take the kernel. `key[0]`: the units."""
        if not key[0]:  # nothing to move: keep what was built for the refits that move something
            return build()
        if self._built is None or self._built[0] != key:
            described = regions()
            ready = bool(described) and all(r is not None for _, r in described)
            batch = (
                ([k for k, _ in described], checksum_kernel.Batch([r for _, r in described]))
                if ready
                else None
            )
            self._built = (key, batch)
        prepared = self._built[1]
        if prepared is None:
            return build()
        sums = Checksums()
        sums.add_batch(*prepared)
        return sums

    def forget(self) -> None:
        self._built = None


def _as_shape(src: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The source box in the destination box's shape (both flatten to the unit's elements in C
    order): a view where the strides allow one, else a contiguous copy, read once more."""
    try:
        return src.view(shape)
    except RuntimeError:
        return src.reshape(shape)


class IpcSender:
    """The sender's side of CUDA IPC links: its tensors (catalog views, `catalog_views`) and one
    refit's steps per `send` (`offer`, then `wait_done`)."""

    def __init__(self, views: Mapping[str, torch.Tensor]) -> None:
        self.views = views
        self._prepared = _Prepared()
        self._exports: dict[str, tuple[tuple, ipc_handles.Export]] = {}  # by name, with its place
        self._event: torch.cuda.Event | None = None  # recorded behind each refit's checksums

    def _export(self, names: Iterable[str]) -> dict[str, ipc_handles.Export]:
        """Each tensor's export, kept while the tensor stays where it was (two driver calls and a
        device switch each: 39 of them cost the host most of a millisecond a refit). A tensor
        freed and another allocated in its place would keep a stale export; the receiver's copy
        then reads other bytes than the sender checksums, and syncd's comparison fails the refit."""
        out = {}
        for name in names:
            tensor = self.views[name]
            known = self._exports.get(name)
            if known is None or known[0] != (tensor.data_ptr(), tensor.shape, tensor.stride()):
                if not tensor.is_cuda:
                    raise ValueError(f"cuda ipc: tensor {name!r} is on {tensor.device}, not a GPU")
                try:
                    export = ipc_handles.export(tensor)
                except RuntimeError as e:
                    raise TransferError(
                        f"cuda ipc: cannot export tensor {name!r} ({e}); memory of expandable segments "
                        "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) has no such handle"
                    ) from e
                known = self._exports[name] = ((tensor.data_ptr(), tensor.shape, tensor.stride()), export)
            out[name] = known[1]
        return out

    def send(
        self, units: Sequence[TransferUnit], channel: Channel, refit: str, timeout_s: float
    ) -> dict[str, str]:
        """One refit to one receiver, all steps: returns the sender's checksums of `units` (keyed
        as the receiver's) once the receiver is done."""
        result = self.offer(units, channel, refit).result()
        self.wait_done(channel, refit, timeout_s)
        return result

    def offer(self, units: Sequence[TransferUnit], channel: Channel, refit: str) -> Checksums:
        """Step 1: enqueue the checksums of the units' regions on this stream, behind the writes
        of the weights, record the interprocess event behind them, and post the exports with the
        event. Returns the checksums (`result()` reads them back; report them at once: the
        receiver does not need them)."""
        error = ipc_units_refusal(units)
        if error:
            raise ValueError(error)
        names = sorted({u.src_tensor for u in units})
        key = (tuple(units), tuple(self.views[n].data_ptr() for n in names))
        regions = lambda: [  # noqa: E731 - built only when the key is new
            (
                checksum_key(u.canonical, u.canon),
                checksum_kernel.describe(self.views[u.src_tensor][u.src_box.slices()]),
            )
            for u in units
        ]
        sums = self._prepared.sums(key, lambda: source_checksums(units, self.views), regions)
        sums.flush()  # the GPU starts on them while the host exports
        exports = self._export(names)
        if self._event is None:
            self._event = torch.cuda.Event(interprocess=True)
        self._event.record()
        channel.post(f"{refit}/ready", pickle.dumps((exports, self._event.ipc_handle())))
        return sums

    def wait_done(self, channel: Channel, refit: str, timeout_s: float) -> None:
        """Step 4: the receiver's answer; only after it may the weights change."""
        answer = channel.take(f"{refit}/done", timeout_s)
        if answer != b"ok":
            raise TransferError(f"cuda ipc: the receiver failed: {answer.decode(errors='replace')}")

    def close(self) -> None:
        """Nothing of the sender's is held for a receiver: its weights are freed as any memory."""
        self._prepared.forget()
        self._exports.clear()
        self._event = None


class IpcReceiver:
    """The receiver's side: the sender's storages it opened (kept across refits) and one refit's
    copies per `receive`."""

    def __init__(self) -> None:
        self._mapped: dict[bytes, ipc_handles.Opened] = {}  # the sender's allocations, by handle
        self._tensors: dict[str, tuple[ipc_handles.Export, torch.Tensor]] = {}  # by tensor name
        self._prepared = _Prepared()
        self._event: tuple[bytes, torch.cuda.Event] | None = None  # the sender's, opened

    def open(self, offer: bytes) -> dict[str, torch.Tensor]:
        """The sender's tensors its offer (step 1's message) names, each allocation mapped once;
        this stream waits (on the GPU) for the sender's event, behind its weights and checksums."""
        exports, event_handle = pickle.loads(offer)
        moved = [n for n, e in exports.items() if n in self._tensors and self._tensors[n][0] != e]
        for name in moved:  # reallocated since the last offer: its old allocation may go
            del self._tensors[name]
        used = {e.handle for e, _ in self._tensors.values()} | {e.handle for e in exports.values()}
        self._release(lambda h: h not in used)
        try:
            if self._event is None or self._event[0] != event_handle:
                event = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), event_handle)
                self._event = (event_handle, event)
        except RuntimeError as err:
            raise TransferError(f"cuda ipc: cannot open the sender's event: {err}") from err
        # On the GPU, behind the sender's checksums (and its weights): two processes' kernels on
        # one GPU take turns rather than share it, so starting the copies earlier gains nothing.
        torch.cuda.current_stream().wait_event(self._event[1])
        out = {}
        for name, e in exports.items():
            if name not in self._tensors:
                if e.handle not in self._mapped:
                    try:
                        self._mapped[e.handle] = ipc_handles.Opened(e.handle)
                    except RuntimeError as err:  # the sender is gone, or on another GPU
                        raise TransferError(
                            f"cuda ipc: cannot open the sender's tensor {name!r}: {err}"
                        ) from err
                self._tensors[name] = (e, self._mapped[e.handle].tensor(e))
            out[name] = self._tensors[name][1]
        return out

    def _release(self, which: Callable[[bytes], bool]) -> None:
        """Unmap the allocations `which` picks (and drop the tensors over them), once no work
        reads them."""
        gone = [h for h in self._mapped if which(h)]
        if gone:
            torch.cuda.current_stream().synchronize()
        if gone:
            self._prepared.forget()  # its regions read the tensors that go
        for h in gone:
            self._tensors = {n: v for n, v in self._tensors.items() if v[0].handle != h}
            self._mapped.pop(h).close()

    def receive(
        self,
        units: Sequence[TransferUnit],
        views: Mapping[str, torch.Tensor],
        channel: Channel,
        refit: str,
        timeout_s: float,
    ) -> dict[str, str]:
        """Copy every unit from the sender's tensors into `views` (catalog views); returns the
        checksums of what landed. The sender is told "done" (or why not) in every case."""
        exports = channel.take(f"{refit}/ready", timeout_s)
        try:
            result = self.copy(units, views, self.open(exports)).result()  # waits for the copies
        except Exception as e:
            channel.post(f"{refit}/done", f"{type(e).__name__}: {e}".encode())
            raise
        channel.post(f"{refit}/done", b"ok")
        return result

    def copy(
        self,
        units: Sequence[TransferUnit],
        views: Mapping[str, torch.Tensor],
        theirs: Mapping[str, torch.Tensor],
    ) -> Checksums:
        """`copy_checksummed`, its kernels prepared once for these units, tensors and places."""
        names = sorted({u.src_tensor for u in units}), sorted({u.dst_tensor for u in units})
        key = (
            tuple(units),
            tuple((id(theirs[n]), theirs[n].data_ptr()) for n in names[0]),
            tuple(views[n].data_ptr() for n in names[1]),
        )

        def regions() -> list:
            out = []
            for u in units:
                dst = views[u.dst_tensor][u.dst_box.slices()]
                src = theirs[u.src_tensor][u.src_box.slices()]
                try:  # a view only: a batch kept for later refits must read the sender's memory
                    described = checksum_kernel.describe_copy(dst, src.view(dst.shape))
                except RuntimeError:
                    described = None
                out.append((checksum_key(u.canonical, u.canon), described))
            return out

        return self._prepared.sums(key, lambda: copy_checksummed(units, views, theirs), regions)

    def close(self) -> None:
        """Unmap everything of the sender's (every end of a refit that is not a commit, and the
        group's end): the driver frees what the sender freed meanwhile."""
        self._release(lambda h: True)
        self._event = None
