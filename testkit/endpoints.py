"""Member endpoints with plain tensors, for refits through a real syncd without vLLM or a trainer
process: what `MemberAgent` drives in a trainer rank and in a generator worker."""

from __future__ import annotations

import numpy as np
import torch

from syncd.layout import Catalog
from syncd.layout.dtypes import torch_dtype
from syncd.member.dataplane import catalog_views
from syncd.plan.simulate import materialize

UNWRITTEN = 0xFF  # every byte of a staged element before it arrives: NaN in every float dtype here


class TrainerEndpoint:
    """A trainer rank's weights in its catalog's local tensors, in the catalog's dtypes."""

    def __init__(self, catalog: Catalog, device: str = "cpu"):
        self.catalog = catalog
        self.params = {
            t.name: torch.zeros(t.shape, dtype=torch_dtype(t.dtype), device=device) for t in catalog.tensors
        }

    def load(self, canonical: dict[str, np.ndarray]) -> None:
        """Canonical values as NumPy arrays of the catalog's dtype, or of its bits (int16 for
        bfloat16, which NumPy lacks)."""
        for name, arr in materialize(self.catalog, canonical).items():
            values = torch.from_numpy(arr)
            self.params[name].view(values.dtype).copy_(values)

    def begin(self, refit_id, version, buckets):
        return catalog_views(self.catalog, self.params)

    def end(self, refit_id, ok):
        pass

    def verify(self, refit_id):
        pass

    def commit(self, refit_id, version, timeout_s):
        pass

    def abort(self):
        pass


class GeneratorEndpoint(TrainerEndpoint):
    """Receives into staging; only a commit makes staged weights live (`params`). Verify fails
    while any staged element was not written."""

    def __init__(self, catalog: Catalog, device: str = "cpu"):
        super().__init__(catalog, device)
        self.version = 0
        self.staging: dict[str, torch.Tensor] | None = None

    def begin(self, refit_id, version, buckets):
        self.staging = {
            name: torch.empty_like(t).view(torch.uint8).fill_(UNWRITTEN).view(t.dtype)
            for name, t in self.params.items()
        }
        return self.staging

    def verify(self, refit_id):
        assert self.staging is not None
        for name, t in self.staging.items():
            unwritten = (t.view(torch.uint8).view(-1, t.element_size()) == UNWRITTEN).all(-1)
            assert not unwritten.any(), f"{name}: {int(unwritten.sum())} elements not received"

    def commit(self, refit_id, version, timeout_s):
        assert self.staging is not None, f"commit of refit {refit_id} with nothing staged"
        self.params, self.staging, self.version = self.staging, None, version

    def abort(self):
        self.staging = None
