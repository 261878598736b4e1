"""The in-place install (`--refit-mode inplace`): received bytes go into the engine's own tensors
while generation is held, layer by layer, with no staging copy of the model.

Before the first byte arrives the API server has paused generation and entered vLLM's layerwise
reload on every worker (`Refitter.hold`). The data plane then hands each received bucket to
`InplaceReceiver.unpack` (a `ReceiveSink`), which writes every unit into its layer:
- a plain layer (norms) straight into its live (kernel) tensors;
- a processed layer (linear, vocab, fused MoE) into checkpoint-format tensors made when its first
  byte arrives: vLLM CPU repacks linear weights into oneDNN handles and prepacks MoE experts, so
  the live kernel tensors cannot take checkpoint bytes. As soon as the layer is complete, vLLM's
  post-processing turns them into the kernel tensors (`install.close_processed`), which frees them.
Extra memory is the data plane's in-flight receive buffers plus the checkpoint tensors of the
layers being received (`peak_open_bytes`): the data plane receives the buckets of all links in
the catalog order of where they land (`position`), so a layer's parts from several trainer ranks
arrive together and it is open about as long as one layer takes to arrive.

Verification: both ends checksum the bytes on the wire (the data plane); each layer's written
regions are checksummed again where they landed, just before its post-processing (`landed`: the
data plane requires them equal to the received ones before it reports the transfer); Verify also
requires every element of every parameter to have arrived, so every layer was post-processed.

Failure after the first layer was installed leaves mixed weights (new layers, old layers). The API
server then never resumes generation: it answers 503 until a complete refit succeeds
(`Refitter.release`). A failure before any layer was installed leaves the engine as it was.

Delta refits (syncd `--delta-inplace`, generator `--inplace-delta-base`): the data plane applies
the changed elements (`syncd.member.dataplane.delta`) to the tensors `delta_targets` names, which
hold the committed version in checkpoint format: a plain layer's live kernel tensors, and for a
processed layer the checkpoint-format copy this receiver kept when the layer was last installed
(`bases`: vLLM CPU repacks linear and MoE weights, so their live tensors cannot take checkpoint
bytes). Every write first saves what it overwrites into an undo log (`generator_svc.worker.undo_log`).
Nothing is post-processed while bytes arrive; at the commit (`install_delta`) each processed
layer the delta changed is post-processed once from its copy, every other layer keeps its kernel
tensors. A delta refit that fails before its commit (a sender lost mid-transfer, a whole-region
checksum that differs because the base was not the sender's) is rolled back: the engine holds the
committed version again, bit for bit, and serves on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from generator_svc.worker.install import (
    close_plain,
    close_processed,
    is_plain,
    open_processed,
    params_by_layer,
    plain_targets,
    uncovered_tensors,
)
from generator_svc.worker.staging import covered_elements
from generator_svc.worker.undo_log import UndoLog
from generator_svc.worker_protocol import WorkerInstall
from syncd.commands import checksum_key
from syncd.layout import Catalog
from syncd.member.dataplane.checksum import Checksums
from syncd.plan import Bucket, landing_order

log = logging.getLogger("generator_svc.worker.inplace")

# How long a rollback waits for the transfer that writes under the undo log to end (its peers'
# abort closes the groups, so it ends within moments; past this, the weights count as torn).
_ROLLBACK_WAIT_S = 30.0


class InstallClosed(RuntimeError):
    """The refit was released (aborted or expired) while bytes still arrived."""


@dataclass
class _Layer:
    path: str
    module: torch.nn.Module
    info: object  # vLLM's LayerReloadingInfo
    shapes: dict[str, tuple[int, ...]]  # catalog tensor name -> the shape its boxes are in
    partial: set[str]  # catalog tensors that pieces do not cover whole: zeroed when opened
    remaining: int  # elements still to arrive, over all its catalog tensors
    targets: dict[str, torch.Tensor] = field(default_factory=dict)  # while open: name -> receive view
    written: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # while open: (unit key, region)
    open_bytes: int = 0
    closed: bool = False


class InplaceReceiver:
    """Receives one version into a model inside vLLM's layerwise reload. Thread-safe: each PP
    stage's receive runs on its own thread; `close` may come from any thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        catalog: Catalog,
        device: torch.device,
        vllm_config=None,
        bases: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """`bases`: the checkpoint-format copies of processed layers' tensors, by catalog name,
        that this receiver refreshes as it installs layers and applies deltas to (None: none kept,
        so no delta can be received)."""
        from generator_svc.vllm_adapter import layerwise_info

        # Where the weights live (the model's own parameters are on the meta device by now).
        self.device = torch.device(device)
        self.report = WorkerInstall()
        self.open_bytes = 0
        self.peak_open_bytes = 0
        self._vllm_config = vllm_config
        self._lock = threading.Condition()
        self._closed = False
        self._bases = bases
        self._transferring = False  # the data plane may be writing (begin..end of a transfer)
        self._delta: dict[str, torch.Tensor] | None = None  # a delta refit's targets, once asked
        self._undo: UndoLog | None = None
        self._delta_received = False  # every delta link arrived and was applied
        self._touched: frozenset[str] = frozenset()  # tensors the delta changed
        self._torn = False  # a delta wrote and could not be rolled back
        self._landed: dict[str, str] = {}
        modules = dict(model.named_modules())
        by_name = {t.name: t for t in catalog.tensors}
        self._layers: dict[str, _Layer] = {}
        self._layer_of: dict[str, _Layer] = {}
        self._landing = landing_order(catalog)
        for path, names in params_by_layer(list(by_name)).items():
            module = modules[path]
            info = layerwise_info(module, path)
            uncovered = uncovered_tensors(module, info, path, set(names))
            if uncovered:
                raise ValueError(
                    f"{path}: {', '.join(uncovered)} not in the catalog, so the in-place install "
                    "cannot fill this layer; use --refit-mode staged (it falls back to vLLM's loaders)"
                )
            covered = {n: covered_elements(by_name[n]) for n in names}
            layer = _Layer(
                path,
                module,
                info,
                {n: by_name[n].shape for n in names},
                {n for n in names if covered[n] < torch.Size(by_name[n].shape).numel()},
                sum(covered.values()),
            )
            self._layers[path] = layer
            self._layer_of.update(dict.fromkeys(names, layer))

    def receive_buffers(self, bucket_bytes: int, in_flight: int) -> None:
        """Record the data plane's receive buffers (`in_flight` of the largest bucket) in the report."""
        self.report.bucket_bytes = bucket_bytes
        self.report.receive_buffer_bytes = bucket_bytes * in_flight

    @property
    def installed_layers(self) -> int:
        return sum(layer.closed for layer in self._layers.values())

    @property
    def is_delta(self) -> bool:
        return self._delta is not None

    def changed_layers(self) -> int:
        """Layers that no longer hold the committed version: those installed, or every layer
        when a delta could not be rolled back (0 after a clean rollback)."""
        return len(self._layers) if self._torn else self.installed_layers

    def unpack(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """Write the bucket's units into their layers; post-process every layer it completes."""
        with self._lock, self._config():
            if self._closed:
                raise InstallClosed("the in-place install was released; not writing more bytes")
            t0 = time.perf_counter()
            offset = 0
            for u in bucket.units:
                layer = self._layer_of[u.dst_tensor]
                target = self._target(layer, u.dst_tensor)[u.dst_box.slices()]
                target.copy_(flat[offset : offset + u.nbytes].view(target.dtype).view(target.shape))
                layer.written.append((checksum_key(u.canonical, u.canon), target))
                offset += u.nbytes
                self.report.bytes_copied += u.nbytes
                layer.remaining -= u.dst_box.numel
                if layer.remaining == 0:
                    self.report.copy_s += time.perf_counter() - t0
                    self._close_layer(layer)
                    t0 = time.perf_counter()
            self.report.copy_s += time.perf_counter() - t0

    def position(self, bucket: Bucket) -> tuple:
        """Receive order (`ReceiveSink`): by the catalog position of the bucket's first unit, so
        that the data plane fills layers one after another whichever trainer rank sends them."""
        return self._landing(bucket)

    def landed(self) -> dict[str, str]:
        """Checksums of every unit written into a layer that is complete, as it was just before
        the layer's post-processing (`ReceiveSink.landed`)."""
        with self._lock:
            return dict(self._landed)

    def missing(self) -> list[str]:
        """Layers not completely received, as 'path (N elements missing)'."""
        return [
            f"{layer.path} ({layer.remaining} elements missing)"
            for layer in self._layers.values()
            if not layer.closed
        ]

    def require_complete(self) -> None:
        if self._delta is not None:
            if not self._delta_received:
                raise ValueError("in-place delta incomplete: its transfer did not finish")
            return
        missing = self.missing()
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"in-place install incomplete: {shown}")

    def close(self) -> None:
        """Accept no more bytes (the refit was released); open layers' tensors are dropped, and
        `finalize_layerwise_reload` puts their previous kernel tensors back. A delta is rolled
        back once its transfer has ended (`transfer_ended`)."""
        with self._lock:
            self._closed = True
            for layer in self._layers.values():
                layer.targets.clear()
                layer.written.clear()
            if self._undo is not None:
                self._undo.close()  # a stage thread still receiving fails on its next write
                if self._lock.wait_for(lambda: not self._transferring, _ROLLBACK_WAIT_S):
                    self._roll_back("the refit was released")
                elif not self._undo.rolled_back:
                    self._torn = True
                    log.error(
                        "in-place delta: the transfer did not end within %.0f s of the release; "
                        "the weights count as torn",
                        _ROLLBACK_WAIT_S,
                    )

    # A delta refit (module docstring): the data plane applies it to `delta_targets`.

    def transfer_started(self) -> None:
        with self._lock:
            self._transferring = True

    def transfer_ended(self, ok: bool) -> None:
        """The data plane wrote its last byte: a delta that failed is rolled back at once."""
        with self._lock:
            self._transferring = False
            self._lock.notify_all()
            if self._undo is None:
                return
            if ok and not self._closed:
                self._delta_received = True
            else:
                self._roll_back("its transfer failed")

    def delta_targets(self) -> tuple[dict[str, torch.Tensor], UndoLog]:
        """The tensors a delta applies to (`DeltaSink`): they hold the committed version in
        checkpoint format; the same for every stage of the transfer."""
        with self._lock:
            if self._closed:
                raise InstallClosed("the in-place install was released; not applying a delta")
            if self._delta is None:
                self._delta = {
                    name: self._delta_target(layer, name)
                    for layer in self._layers.values()
                    for name in layer.shapes
                }
                self._undo = UndoLog()
            assert self._undo is not None  # made with the targets
            return self._delta, self._undo

    def touch(self, changed: frozenset[str]) -> None:
        """The tensors the delta changed (the rest still hold the committed version)."""
        self._touched = changed

    def install_delta(self) -> WorkerInstall:
        """At the commit: post-process once each processed layer the delta changed, from its
        copy; every other layer gets its kernel tensors back as they are (plain layers took the
        delta in them already). The undo log is dropped: the new version is live."""
        t0 = time.perf_counter()
        with self._lock, self._config():
            if self._closed or self._undo is None:
                raise InstallClosed("no in-place delta is open to install")
            self._undo.discard()
            self._undo = None  # committed: nothing to roll back, even if post-processing fails
            for layer in self._layers.values():
                if self._touched.isdisjoint(layer.shapes):
                    close_plain(layer.module, layer.info)
                    self.report.layers_kept += 1
                elif is_plain(layer.module):  # the delta went into its kernel tensors
                    close_plain(layer.module, layer.info)
                else:
                    self._process_from_bases(layer)
                layer.closed = True
            self._closed = True
        self.report.total_s = time.perf_counter() - t0
        return self.report

    def _delta_target(self, layer: _Layer, name: str) -> torch.Tensor:
        if is_plain(layer.module):
            return _receive_view(plain_targets(layer.info)[_param(name)], layer.shapes[name], name)
        base = None if self._bases is None else self._bases.get(name)
        if base is None:
            raise ValueError(
                f"{name}: this in-place generator keeps no checkpoint-format copy to apply a delta to; "
                "start it with --inplace-delta-base, or run syncd without --delta-inplace"
            )
        return base

    def _process_from_bases(self, layer: _Layer) -> None:
        assert self._bases is not None  # `_delta_target` required them
        open_processed(layer.module, layer.info)
        t0 = time.perf_counter()
        for name, shape in layer.shapes.items():
            live = getattr(layer.module, _param(name)).data
            _receive_view(live, shape, name).copy_(self._bases[name])
            self.report.params_copied += 1
            self.report.bytes_copied += live.numel() * live.element_size()
        self.report.copy_s += time.perf_counter() - t0
        close_processed(layer.module, layer.info, self.report)

    def _roll_back(self, why: str) -> None:
        assert self._undo is not None  # a delta was applied
        if self._undo.rolled_back:
            return
        nbytes = self._undo.nbytes
        undone, overwritten = self._undo.rollback()
        log.warning(
            "in-place delta rolled back (%s): %d writes undone, %d of them had changed bits; %d bytes",
            why,
            undone,
            overwritten,
            nbytes,
        )

    def _target(self, layer: _Layer, name: str) -> torch.Tensor:
        target = layer.targets.get(name)
        if target is not None:
            return target
        if not layer.targets and not is_plain(layer.module):
            open_processed(layer.module, layer.info)
            layer.open_bytes = sum(
                p.numel() * p.element_size() for p in layer.module.parameters(recurse=False)
            )
            self._opened(layer.open_bytes)
        live = (
            plain_targets(layer.info)[_param(name)]
            if is_plain(layer.module)
            else getattr(layer.module, _param(name)).data
        )
        layer.targets[name] = target = _receive_view(live, layer.shapes[name], name)
        if name in layer.partial:  # what no piece fills is zero, as in staging
            target.zero_()
        self.report.params_copied += 1
        return target

    def _close_layer(self, layer: _Layer) -> None:
        sums = Checksums()  # what landed, before post-processing turns it into kernel tensors
        for key, region in layer.written:
            sums.add_region(key, region)
        self._landed.update(sums.result())
        layer.written.clear()
        if is_plain(layer.module):
            close_plain(layer.module, layer.info)
        else:
            self._keep_bases(layer)
            close_processed(layer.module, layer.info, self.report)
        layer.targets.clear()
        layer.closed = True
        self._opened(-layer.open_bytes)

    def _keep_bases(self, layer: _Layer) -> None:
        """Keep the layer's checkpoint-format tensors before post-processing transforms them: what
        the next delta applies to (only where the worker keeps delta bases)."""
        if self._bases is None:
            return
        for name, target in layer.targets.items():
            base = self._bases.get(name)
            if base is None or base.shape != target.shape or base.dtype != target.dtype:
                self._bases[name] = target.clone()
            else:
                base.copy_(target)

    def _opened(self, nbytes: int) -> None:
        self.open_bytes += nbytes
        self.peak_open_bytes = max(self.peak_open_bytes, self.open_bytes)
        self.report.peak_open_bytes = self.peak_open_bytes

    def _config(self) -> contextlib.AbstractContextManager[None]:
        """vLLM's current config while post-processing runs on the data plane's thread."""
        from generator_svc.vllm_adapter import vllm_config_context

        return vllm_config_context(self._vllm_config)


def _param(name: str) -> str:
    return name.rpartition(".")[2]


def _receive_view(live: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """`live` seen in the catalog's shape. A vocab-parallel shard has more rows than the catalog
    covers (padding, filled by no canonical tensor): its padding is zeroed, as vLLM's loader does
    (`install.copy_into`), and the view is its first rows."""
    if tuple(live.shape) == tuple(shape):
        return live
    if live.numel() == torch.Size(shape).numel():
        return live.view(shape)
    rows = shape[0]
    if live.dim() != len(shape) or tuple(live.shape[1:]) != tuple(shape[1:]) or live.shape[0] < rows:
        raise ValueError(
            f"{name}: catalog shape {tuple(shape)} does not fit parameter shape {tuple(live.shape)}"
        )
    live[rows:].zero_()
    return live[:rows]
