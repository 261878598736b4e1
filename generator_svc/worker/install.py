"""Install received weights into vLLM's parameters: one copy per parameter, then vLLM's per-layer
post-processing once per layer.

The bytes arrive in checkpoint format, one buffer per vLLM parameter (the catalog's local tensors,
`Staging.buffers`). vLLM's loader path would split them back into HF tensors (9,435 for a
24-layer x 128-expert model) and route each through its per-layer loaders; here each parameter is
a single copy instead.

Runs inside vLLM's weight-update lifecycle, between `initialize_layerwise_reload` (which put every
layer's checkpoint-format tensors on the meta device and kept its live "kernel" tensors aside) and
`finalize_layerwise_reload` (which puts kernel tensors back on every layer nothing was installed
into). Per layer that owns catalog parameters:

- a layer without a quantization method (norms) is installed by copying straight into its kept
  kernel tensors, which go back on the layer: one copy, nothing to process;
- any other layer (linear, vocab, fused MoE) gets real checkpoint-format tensors, the copies, and
  its quant method's `process_weights_after_loading` (on CPU: oneDNN/sgl repack of linear weights,
  whose visible Parameter is then empty, and the MoE prepack with the CPU MoE fix in
  `vllm_adapter`); the processed values then go into the kept kernel tensors, as vLLM's own
  reload does. This is what the kernels read, so installing never writes into the (possibly
  empty) visible Parameters of a repacked layer.

A layer whose loadable tensors the catalog does not all cover cannot be installed by copies; its
canonical tensors go through vLLM's `load_weights` (the fallback), named in the report.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import torch

from generator_svc.worker_protocol import WorkerInstall
from syncd.layout import owning_layer

log = logging.getLogger("generator_svc.worker.install")


def copy_into(param: torch.Tensor, staged: torch.Tensor) -> None:
    """Copy one staged parameter into its live tensor. A vocab-parallel shard is longer than what
    was staged (padded rows belong to no canonical tensor): its padding is zeroed, as vLLM's loader
    does."""
    if param.shape == staged.shape:
        param.copy_(staged)
        return
    rows = staged.shape[0]
    if param.dim() != staged.dim() or param.shape[1:] != staged.shape[1:] or param.shape[0] < rows:
        raise ValueError(
            f"staged shape {tuple(staged.shape)} does not fit parameter shape {tuple(param.shape)}"
        )
    param[:rows].copy_(staged)
    param[rows:].zero_()


def copy_parameters(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> int:
    """Install `buffers` into same-named `params` (one `copy_into` each); returns the bytes copied.
    The whole install where parameters need no post-processing (unquantized weights on GPU)."""
    copied = 0
    for name, param in params.items():
        staged = buffers[name]
        copy_into(param, staged)
        copied += staged.numel() * staged.element_size()
    return copied


def params_by_layer(names: list[str]) -> dict[str, list[str]]:
    """Catalog tensor names (full parameter names) grouped by owning module path, in order."""
    out: dict[str, list[str]] = defaultdict(list)
    for name in names:
        out[owning_layer(name)].append(name)
    return dict(out)


def install_into_model(
    model: torch.nn.Module, buffers: dict[str, torch.Tensor], changed: frozenset[str] | None = None
) -> WorkerInstall:
    """Install `buffers` (parameter name -> staged checkpoint-format tensor) into `model`, which must
    be inside the layerwise-reload lifecycle. `changed` (after a delta refit): the only parameters
    that differ from what the model runs; a layer holding none of them keeps its kernel tensors, so
    it is neither copied nor post-processed. Returns what was done; the parameters of layers that
    need vLLM's loaders are listed in `fallback_params` and NOT installed (the caller feeds them to
    `load_weights`)."""
    from generator_svc import vllm_adapter as vllm

    start = time.perf_counter()
    report = WorkerInstall()
    modules = dict(model.named_modules())
    for path, names in params_by_layer(list(buffers)).items():
        layer = modules[path]
        info = vllm.layerwise_info(layer, path)
        if changed is not None and changed.isdisjoint(names):
            close_plain(layer, info)  # the kernel tensors it kept aside go back unchanged
            report.layers_kept += 1
            continue
        uncovered = uncovered_tensors(layer, info, path, buffers)
        if uncovered:
            log.warning(
                "%s: %s not in the catalog; installing this layer through vLLM's loaders",
                path,
                ", ".join(uncovered),
            )
            report.fallback_params.extend(names)
            continue
        if is_plain(layer):
            _install_plain(layer, info, path, buffers, report)
        else:
            _install_processed(layer, info, path, buffers, report)
    report.total_s = time.perf_counter() - start
    return report


def uncovered_tensors(layer, info, path: str, names) -> list[str]:
    """Loadable tensors of the layer (checkpoint-format parameters and persistent buffers) that no
    staged buffer fills."""
    from generator_svc.vllm_adapter import checkpoint_tensors

    params, layer_buffers = checkpoint_tensors(info)
    loadable = list(params) + [n for n in layer_buffers if n not in layer._non_persistent_buffers_set]
    return [n for n in loadable if f"{path}.{n}" not in names]


def _install_plain(layer, info, path: str, buffers, report: WorkerInstall) -> None:
    kernel_params = plain_targets(info)
    t0 = time.perf_counter()
    report.bytes_copied += copy_parameters(kernel_params, {n: buffers[f"{path}.{n}"] for n in kernel_params})
    report.params_copied += len(kernel_params)
    report.copy_s += time.perf_counter() - t0
    close_plain(layer, info)


def _install_processed(layer, info, path: str, buffers, report: WorkerInstall) -> None:
    from generator_svc.vllm_adapter import checkpoint_tensors

    open_processed(layer, info)
    t0 = time.perf_counter()
    for name in checkpoint_tensors(info)[0]:
        _copy(getattr(layer, name).data, buffers[f"{path}.{name}"], report)
    report.copy_s += time.perf_counter() - t0
    close_processed(layer, info, report)


# The per-layer steps, shared with the in-place receive (`generator_svc.worker.inplace`), which writes the
# arriving bytes between a layer's open and close instead of copying from staging.


def is_plain(layer) -> bool:
    """A layer without a quantization method (norms): its kernel tensors are its checkpoint
    tensors, so the bytes go straight into them."""
    from generator_svc.vllm_adapter import quant_method

    return quant_method(layer) is None


def plain_targets(info) -> dict[str, torch.Tensor]:
    """The kept kernel tensors of a plain layer, by parameter name: where its bytes are written."""
    from generator_svc.vllm_adapter import kernel_parameters

    return kernel_parameters(info)


def close_plain(layer, info) -> None:
    """Put the layer's kept kernel tensors back and end its reload (nothing to process)."""
    from generator_svc.vllm_adapter import restore_kernel_tensors

    restore_kernel_tensors(layer, info)


def open_processed(layer, info) -> None:
    """Give the layer real checkpoint-format tensors (new memory, freed by `close_processed`)."""
    from generator_svc.vllm_adapter import materialize_checkpoint_tensors

    materialize_checkpoint_tensors(layer, info)


def close_processed(layer, info, report: WorkerInstall) -> None:
    """vLLM's post-processing of the filled checkpoint tensors, whose results go into the kept
    kernel tensors (vLLM's own steps of `_layerwise_process`, without the loader calls)."""
    from generator_svc.vllm_adapter import process_weights, store_processed_tensors

    t0 = time.perf_counter()
    process_weights(layer)
    report.process_s += time.perf_counter() - t0
    store_processed_tensors(layer, info)
    report.layers_processed += 1


def _copy(param: torch.Tensor, staged: torch.Tensor, report: WorkerInstall) -> None:
    copy_into(param, staged)
    report.params_copied += 1
    report.bytes_copied += staged.numel() * staged.element_size()
