"""Test and benchmark aids that run inside a vLLM worker of generator_svc (no production code
calls them). Pass them to `LLM.collective_rpc(fn, args=...)`: vLLM calls `fn(worker, *args)` on
every worker (set `VLLM_ALLOW_INSECURE_SERIALIZATION=1`, and the repository on `PYTHONPATH`).

- `dump_loaded`, `dump_installed`, `dump_inplace`: every parameter in checkpoint format after
  vLLM's own loaders, the staged install, or the in-place install wrote it
  (`tests/generator/engine_probe.py`, `test_generator_coverage.py`);
- `checkpoint_buckets`, `install_buckets`: the in-place install of a checkpoint without a network
  (`dump_inplace`, `bench/apply_bench.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from generator_svc.worker.inplace import InplaceReceiver
from syncd.layout import Catalog
from syncd.plan import Bucket


def dump_loaded(worker: Any, checkpoint: str, out_dir: str) -> str:
    """Reload `checkpoint` through vLLM's own loader inside the layerwise reload and save every
    parameter as vLLM's loaders wrote it (checkpoint format, before kernel processing) to
    `{out_dir}/tp{rank}.safetensors`. The engine serves `checkpoint` afterwards."""
    from generator_svc import vllm_adapter as vllm

    model = worker._ws_model()

    def load() -> None:
        with vllm.set_current_vllm_config(worker.vllm_config):
            vllm.initialize_layerwise_reload(model)
            try:
                model.load_weights(read_checkpoint(checkpoint))
            finally:
                vllm.finalize_layerwise_reload(model, worker.model_config)

    return _dump(worker, load, f"{out_dir}/tp{worker._ws_tp()[0]}.safetensors")


def dump_installed(worker: Any, checkpoint: str, out_dir: str) -> str:
    """Like `dump_loaded`, but through the staged refit path (stage `checkpoint`, then the update
    lifecycle with the install by parameter), to `{out_dir}/installed-tp{rank}.safetensors`. The
    worker must run the staged mode."""

    def install() -> None:
        staging = worker._ws_mode.staging
        staging.begin("dump")
        staging.fill_from_safetensors(checkpoint)
        worker.start_weight_update()
        worker.update_weights({"version": "dump"})
        worker.finish_weight_update()
        staging.discard()

    return _dump(worker, install, f"{out_dir}/installed-tp{worker._ws_tp()[0]}.safetensors")


def dump_inplace(worker: Any, checkpoint: str, out_dir: str, bucket_bytes: int = 1 << 16) -> dict[str, Any]:
    """Like `dump_installed`, through the in-place install: `checkpoint` packed into buckets of
    `bucket_bytes` as a one-rank trainer would send them (`checkpoint_buckets`), each handed to an
    `InplaceReceiver` inside the layerwise reload. Saves `{out_dir}/inplace-tp{rank}.safetensors`;
    returns the receiver's report."""
    packed = checkpoint_buckets(worker._ws_catalog, worker._ws_member_id, checkpoint, bucket_bytes)
    out: dict[str, Any] = {}

    def install() -> None:
        receiver = install_buckets(
            worker._ws_model(), worker._ws_catalog, worker.device, worker.vllm_config, packed
        )
        out.update(receiver.report.to_wire())

    _dump(worker, install, f"{out_dir}/inplace-tp{worker._ws_tp()[0]}.safetensors")
    return out


def _dump(worker: Any, run: Callable[[], None], out_path: str) -> str:
    """Run `run` and save every parameter in checkpoint format: the values each layer's
    `process_weights_after_loading` received (before kernel repacking), and the parameters of
    layers that have no processing as they are afterwards."""
    from safetensors.torch import save_file

    from generator_svc import vllm_adapter as vllm

    model = worker._ws_model()
    captured: dict[str, torch.Tensor] = {}
    restore = []
    for path, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, vllm.QuantizeMethodBase):
            original = method.process_weights_after_loading

            def capture(layer: torch.nn.Module, _path: str = path, _orig: Any = original) -> Any:
                for n, p in layer.named_parameters(recurse=False):
                    captured[f"{_path}.{n}"] = p.detach().clone()
                return _orig(layer)

            method.process_weights_after_loading = capture  # undone below
            restore.append(method)
    try:
        run()
    finally:
        for method in restore:
            del method.process_weights_after_loading
    for n, p in model.named_parameters():
        captured.setdefault(n, p.detach().clone())
    save_file({k: v.contiguous() for k, v in captured.items()}, out_path)
    return out_path


def read_checkpoint(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                yield name, f.get_tensor(name)


def checkpoint_buckets(
    catalog: Catalog, member_id: str, checkpoint: str, bucket_bytes: int
) -> list[tuple[Bucket, torch.Tensor]]:
    """(bucket, packed bytes) of `checkpoint` as a sender would send them to `member_id`, planned
    as one source holding every canonical tensor whole (the same buckets a one-rank trainer
    sends, without a network)."""
    from safetensors.torch import load_file

    from syncd.layout import Canon, CanonicalTensor, hf_names, local_tensor
    from syncd.layout.dtypes import torch_dtype
    from syncd.member.dataplane import pack_into
    from syncd.plan import DestMember, SourceMember, make_plan

    dtype = {c.name: c.dtype for c in catalog.canonical}
    canonical = {}
    for file in sorted(Path(checkpoint).glob("*.safetensors")):
        grouped = hf_names.group_from_hf(load_file(str(file)).items(), lambda ts: torch.stack(list(ts)))
        for name, t in grouped.items():
            if name in dtype:
                canonical[name] = t.to(torch_dtype(dtype[name]))
    source = Catalog(
        tuple(CanonicalTensor(n, tuple(t.shape), dtype[n]) for n, t in canonical.items()),
        tuple(local_tensor(n, dtype[n], Canon(n, tuple(t.shape))) for n, t in canonical.items()),
    )
    plan = make_plan(
        [SourceMember("checkpoint", 0, source)],
        [DestMember(member_id, catalog, by_layer=True)],
        bucket_bytes=bucket_bytes,
    )
    return [
        (b, pack_into(b, canonical, torch.empty(b.nbytes, dtype=torch.uint8)).clone())
        for b in plan.for_member(member_id)
    ]


def install_buckets(
    model: torch.nn.Module,
    catalog: Catalog,
    device: torch.device,
    vllm_config: Any,
    packed: list[tuple[Bucket, torch.Tensor]],
) -> InplaceReceiver:
    """The whole in-place install of already packed buckets inside vLLM's layerwise reload (what a
    refit does between hold and commit, without the wire). Returns the receiver (its report)."""
    from generator_svc import vllm_adapter as vllm

    with vllm.set_current_vllm_config(vllm_config):
        vllm.initialize_layerwise_reload(model)
        try:
            receiver = InplaceReceiver(model, catalog, device, vllm_config)
            for bucket, flat in packed:
                receiver.unpack(bucket, flat)
            receiver.require_complete()
        finally:
            vllm.finalize_layerwise_reload(model, vllm_config.model_config)
    return receiver
