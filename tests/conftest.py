"""Suite-wide settings: GPU tests skip where there are no GPUs."""

from __future__ import annotations

import pytest


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - whatever breaks torch's CUDA probe means no usable GPU: gpu tests skip
        return 0


def pytest_collection_modifyitems(config, items):
    gpus = _gpu_count()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.kwargs.get("count", 1)
        if gpus < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} GPU(s), found {gpus}"))
