"""Work around a vLLM 0.32 CPU bug: fused-MoE experts are not re-prepacked after a weight update.

`UnquantizedFusedMoEMethod._setup_kernel` runs the experts kernel's `process_weights_after_loading`
only on the first load (when no kernel exists yet). On CPU that hook prepacks w13/w2 into the
grouped-gemm layout, so after a layerwise reload the experts compute with unpacked weights and the
outputs are silently wrong. The patch calls the hook on updates too. Applied once per worker
process, only on the CPU platform; idempotent.
"""

from __future__ import annotations

_MARK = "_generator_svc_prepack_on_update"


def apply_cpu_moe_fix() -> bool:
    """Patch the method on CPU. Returns whether the patch is (now) in place."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    original = UnquantizedFusedMoEMethod._setup_kernel
    if getattr(original, _MARK, False):
        return True

    def _setup_kernel(self, layer, w13, w2):
        is_weight_update = self.moe_kernel is not None
        original(self, layer, w13, w2)
        if is_weight_update:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    setattr(_setup_kernel, _MARK, True)
    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel  # type: ignore[method-assign]  # the patch itself
    return True
