"""Code that runs inside vLLM's worker processes (one per tensor-parallel rank).

vLLM loads the worker extension by the string `generator_svc.worker.WeightSyncExtension`
(`worker_extension_cls`) in every worker before its model loads. This package's `__init__` imports
nothing itself: the extension's module (`extension`) is imported when vLLM asks for the class, so
importing a pure module of the package (`catalog`, `undo_log`, `digest`) stays light.

Nothing here imports `generator_svc.server` (the API-server process) or `generator_svc.attach`
(users' own engines): the worker is driven from there only through vLLM's `collective_rpc`, with
plain data. Shared with them: `generator_svc.settings` (the mode enums), `generator_svc.vllm_adapter`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from generator_svc.worker.extension import WeightSyncExtension

__all__ = ["WeightSyncExtension"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the extension's module registers the weight-transfer engine with vLLM
    # and applies the CPU MoE fix as it loads, which only a worker (or a check of it) wants.
    if name == "WeightSyncExtension":
        from generator_svc.worker.extension import WeightSyncExtension

        return WeightSyncExtension
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
