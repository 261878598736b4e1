"""Staging: the receive buffers of one worker, and the feed from them into vLLM's loaders.

Lifecycle per refit: `begin(refit_id)` -> the data plane (or `fill_from_safetensors`) writes boxes
with `write` -> `missing()` / `checksums()` for verification -> `generator_svc.worker.install`
copies `buffers` into vLLM's parameters inside the update lifecycle (`hf_weights()` feeds vLLM's
`load_weights` only for layers the install cannot do by copies) -> `begin` of the next refit.

One buffer per local tensor of the worker's catalog, shaped `LocalTensor.shape`, allocated once and
reused: staged mode costs one extra copy of this worker's shard of the model, never the full model.

Feeding TP-sharded staging into vLLM's loaders: vLLM's loaders take full HF tensors and narrow them
to their rank (`loaded_weight.narrow(dim, tp_rank * shard, shard)`), differently per layer type
(QKV with replicated kv heads, merged column, fused MoE, vocab shards). Rather than re-implement
those rules, `hf_weights()` yields, one HF tensor at a time, a tensor of the full HF shape whose
region this rank holds is filled from staging (the rest is zeros and never read by the loader):
- a region held by one piece is yielded as a zero-copy view of staging (all of TP=1, and
  replicated tensors at any TP);
- otherwise a transient buffer of one HF tensor is allocated (grouped experts are fed per expert,
  so the transient is one `[I, H]` matrix, not `[E, I, H]`), and dropped after the loader copied it.
Peak extra memory is therefore the largest single HF tensor (the embedding or lm_head at TP>1).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from syncd.layout import Box, Catalog, LocalTensor, Piece, hf_names, owning_layer
from syncd.layout.dtypes import conversion, torch_dtype
from syncd.plan.types import Bucket


class StagingInputError(ValueError):
    """What a worker was asked to stage is not a checkpoint of its catalog (no such file, not
    safetensors, a shape or dtype the catalog does not have): the caller's input, not a bug."""


def covered_elements(t: LocalTensor) -> int:
    """Elements of `t` that some piece fills (a padded vocab shard has more that none does)."""
    return sum(p.local.numel for p in t.pieces)


class Staging:
    """Receive buffers for one catalog. Not thread-safe: one writer (the data plane) at a time."""

    def __init__(self, catalog: Catalog, device: torch.device | str = "cpu") -> None:
        self.catalog = catalog
        self.tensors = {t.name: t for t in catalog.tensors}
        self.device = torch.device(device)
        self.buffers = {
            t.name: torch.zeros(t.shape, dtype=torch_dtype(t.dtype), device=self.device)
            for t in catalog.tensors
        }
        self._by_canonical: dict[str, list[tuple[str, Piece]]] = defaultdict(list)
        for t in catalog.tensors:
            for p in t.pieces:
                self._by_canonical[p.canonical].append((t.name, p))
        self.refit_id: str | None = None
        self._received: dict[str, int] = {}
        # After a delta refit: the buffers it changed (the rest hold what the engine runs); None
        # when the whole version was written.
        self.changed: frozenset[str] | None = None

    @property
    def nbytes(self) -> int:
        return self.catalog.nbytes

    def begin(self, refit_id: str, planned: frozenset[str] | None = None) -> None:
        """Start receiving a new version; what an earlier, unfinished refit wrote no longer counts.
        `planned`: the local tensors this refit writes, when it writes only some (a partial
        trainer's refit, `Catalog.partial`); every other buffer keeps what the engine serves, and
        the install copies only the layers of `planned`, each of which it must fill whole."""
        self.refit_id = refit_id
        self.changed = None
        if planned is not None and planned < {n for n, t in self.tensors.items() if t.pieces}:
            require_whole_layers(planned, self.buffers)
            self.changed = planned
        self._received = dict.fromkeys(self.buffers if self.changed is None else self.changed, 0)

    def write(self, tensor: str, box: Box, data: torch.Tensor) -> None:
        """Data-plane entry: copy `data` (C order, `box.numel` elements) into region `box` of `tensor`."""
        if self.refit_id is None:
            raise RuntimeError("staging.write before begin(refit_id)")
        buf = self.buffers.get(tensor)
        if buf is None:
            raise ValueError(f"unknown staging tensor {tensor}")
        if not box.within(tuple(buf.shape)):
            raise ValueError(f"box {box} is outside staging tensor {tensor} of shape {tuple(buf.shape)}")
        if data.numel() != box.numel or data.dtype != buf.dtype:
            raise ValueError(
                f"{tensor}{box}: got {data.numel()} x {data.dtype}, expected {box.numel} x {buf.dtype}"
            )
        buf[box.slices()] = data.reshape(box.shape)
        self._received[tensor] += box.numel

    def fill_canonical(self, name: str, region: Box, data: torch.Tensor) -> None:
        """Write `data` (region `region` of canonical tensor `name`) into every piece it meets."""
        for tensor, piece in self._by_canonical.get(name, ()):
            hit = piece.canon.intersect(region)
            if hit is None:
                continue
            src = data[tuple(slice(a - r, b - r) for a, b, r in zip(hit.start, hit.stop, region.start))]
            self.write(tensor, piece.local_region(hit), src.contiguous())

    def fill_from_safetensors(self, path: str | Path) -> dict[str, int]:
        """Stage the canonical tensors a safetensors file (or every `*.safetensors` of a directory)
        holds, reading only this worker's boxes, converted to the catalog's dtype as vLLM's startup
        converts (`syncd.layout.dtypes.conversion`: float32 -> bfloat16/float16 round to nearest
        even). Tensors the catalog does not know are skipped. Returns {"tensors": staged canonical
        tensors, "skipped": unknown ones}. Raises StagingInputError, naming it, for a path that is
        no such checkpoint, a tensor whose shape disagrees with the catalog, or a dtype that cannot
        be converted."""
        files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else [Path(path)]
        if not files:
            raise StagingInputError(f"no safetensors files at {path}")
        staged, skipped = 0, 0
        for file in files:
            with _open_safetensors(file) as f:
                names = list(f.keys())
                shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
                for name, shape in hf_names.canonical_shapes_from_hf(shapes).items():
                    canon = self.catalog.canonical_by_name.get(name)
                    if canon is None:
                        skipped += 1
                        continue
                    if shape != canon.shape:
                        raise StagingInputError(
                            f"{name}: checkpoint shape {shape} != catalog shape {canon.shape}"
                        )
                    self._fill_from_file(f, canon.name, canon.dtype)
                    staged += 1
        return {"tensors": staged, "skipped": skipped}

    def _fill_from_file(self, f, name: str, dtype: str) -> None:
        for _, piece in self._by_canonical[name]:
            box = piece.canon
            if hf_names.is_grouped_expert(name):
                rows = [
                    f.get_slice(hf_names.hf_expert_name(name, e))[box.slices()[1:]]
                    for e in range(box.start[0], box.stop[0])
                ]
                data = torch.stack(rows)
            else:
                data = f.get_slice(name)[box.slices()]
            source = str(data.dtype).removeprefix("torch.")
            if source != dtype:
                # As vLLM's startup loader does (its copy into the parameter rounds to nearest
                # even); pairs the project cannot convert are the caller's input, named.
                try:
                    conversion(source, dtype, tensor=name)
                except ValueError as e:
                    raise StagingInputError(str(e)) from None
                data = data.to(torch_dtype(dtype))
            self.fill_canonical(name, box, data)

    def missing(self) -> list[str]:
        """Local tensors not completely received, as 'name (got/expected elements)' (of a partial
        refit, only those it writes)."""
        out = []
        for name, t in self.tensors.items():
            if self.changed is not None and name not in self.changed:
                continue
            got, want = self._received.get(name, 0), covered_elements(t)
            if got != want:
                out.append(f"{name} ({got}/{want} elements)")
        return out

    def require_complete(self) -> None:
        if self.refit_id is None:
            raise ValueError("nothing staged: no refit has begun on this worker")
        missing = self.missing()
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"refit {self.refit_id}: staging incomplete: {shown}")

    def mark_received(self, buckets: tuple[Bucket, ...], member_id: str) -> int:
        """Count the units the data plane unpacked straight into `buffers` for `member_id`."""
        total = 0
        for b in buckets:
            if b.dst != member_id:
                continue
            for u in b.units:
                self._received[u.dst_tensor] += u.dst_box.numel
            total += b.nbytes
        return total

    def discard(self) -> None:
        """Drop what an unfinished refit staged (Abort); the committed weights are untouched."""
        self.refit_id = None
        self._received = {}

    def hf_weights(self, tensors: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full-shape tensor) pairs for vLLM's `load_weights`, parameter by parameter
        (only the canonical tensors of local tensors `tensors` when given). See the module
        docstring for what is a view and what is a transient buffer."""
        done: set[str] = set()
        for t in self.catalog.tensors:
            if tensors is not None and t.name not in tensors:
                continue
            for p in t.pieces:
                if p.canonical in done:
                    continue
                done.add(p.canonical)
                canon = self.catalog.canonical_by_name[p.canonical]
                if hf_names.is_grouped_expert(canon.name):
                    for e in range(canon.shape[0]):
                        region = Box((e, 0, 0), (e + 1, *canon.shape[1:]))
                        yield hf_names.hf_expert_name(canon.name, e), self._region(canon.name, region)[0]
                else:
                    yield canon.name, self._region(canon.name, Box.full(canon.shape))

    def _region(self, name: str, region: Box) -> torch.Tensor:
        hits = [
            (tensor, piece, hit)
            for tensor, piece in self._by_canonical[name]
            if (hit := piece.canon.intersect(region)) is not None
        ]
        if len(hits) == 1 and hits[0][2] == region:
            tensor, piece, hit = hits[0]
            return self.buffers[tensor][piece.local_region(hit).slices()].reshape(region.shape)
        out = torch.zeros(
            region.shape, dtype=torch_dtype(self.catalog.canonical_by_name[name].dtype), device=self.device
        )
        for tensor, piece, hit in hits:
            local = self.buffers[tensor][piece.local_region(hit).slices()]
            dst = tuple(slice(a - r, b - r) for a, b, r in zip(hit.start, hit.stop, region.start))
            out[dst] = local.reshape(hit.shape)
        return out


def planned_tensors(buckets: Sequence[Bucket], member_id: str) -> frozenset[str]:
    """The local tensors that `member_id`'s buckets of a plan write into."""
    return frozenset(u.dst_tensor for b in buckets if b.dst == member_id for u in b.units)


def require_whole_layers(planned: frozenset[str], tensors: Iterable[str]) -> None:
    """A partial refit installs by layer (`generator_svc.worker.install`): a layer it writes must
    get every one of its tensors, or the install would copy stale staging into the others."""
    by_layer: dict[str, set[str]] = defaultdict(set)
    for name in tensors:
        by_layer[owning_layer(name)].add(name)
    for layer, names in by_layer.items():
        left_out = names - planned
        if left_out and left_out != names:
            raise ValueError(
                f"a partial refit writes only part of layer {layer}: not {sorted(left_out)}; "
                "its sources must declare every canonical tensor of the layers they change "
                "(e.g. a LoRA adapter on q_proj needs k_proj and v_proj too, fused as qkv_proj)"
            )


def _open_safetensors(file: Path) -> Any:
    """`safe_open(file)`; a missing or unreadable file is the caller's input: StagingInputError."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt")
    except (OSError, ValueError, SafetensorError) as e:  # ValueError: a path that cannot be encoded
        # repr: the path may hold characters no encoding carries (a lone surrogate from JSON)
        raise StagingInputError(f"{str(file)!r} is not a readable safetensors file: {e!r}") from e
