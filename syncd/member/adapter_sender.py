"""The front door for a trainer of one named LoRA adapter: its factors go into the generators'
adapter slots through syncd (`syncd.layout.adapters`), versioned as the adapter's own.

    sender = attach_adapter("syncd:8471", "policy-a", factors, alpha=16.0, target_modules=("q_proj",))
    for step in range(1, steps + 1):
        train(factors)                     # under sender.lock, as the data plane reads them in place
        sender.publish(step, wait_s=60)    # version `step` of policy-a, once every generator serves it
                                           # (syncd --auto-refit; else: syncctl refit --adapter policy-a)
    sender.close()

A model holding LoRA modules gives its factors with `lora_factors(model)` (PEFT's `LoraModel`, or
modules with `lora_A` / `lora_B` parameters): the live parameters, so the sender reads what the
optimizer wrote.

`factors` are PEFT's names without the `base_model.model.` prefix
(`model.layers.0.self_attn.q_proj.lora_A.weight [rank, in]`, `lora_B [out, rank]`), whole, in any
dtype syncd converts to the slots' (float32 into bfloat16 slots, say). The rank is the factors'.
Every adapter is a member of its own (`adapter-<name>-0`), kept out of base refits; its run id
makes each start of the trainer a new run of the adapter, whose versions count from 1 again.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Mapping

import torch

from syncd.layout import Canon, CanonicalTensor, Catalog, local_tensor
from syncd.layout.adapters import AdapterSpec, adapter_rank
from syncd.member.membership import Membership, join
from syncd.member.refit_outcomes import RefitOutcome, wait_served
from syncd.member.sender import SenderEndpoint
from syncd.vocabulary import Role
from syncd.weight_version import WeightVersion, parse_weight_version


class AdapterSender:
    """One named adapter's trainer: holds the factors syncd reads in place, under `lock` (the
    `HeldWeights` of its `SenderEndpoint`); `membership` is set once it joined syncd."""

    membership: Membership

    def __init__(self, spec: AdapterSpec, factors: Mapping[str, torch.Tensor]) -> None:
        self.spec = spec
        self.factors = dict(factors)
        self.lock = threading.Lock()  # taken by a transfer from its begin to its end
        self.version = WeightVersion(0)

    def views(self) -> Mapping[str, torch.Tensor]:
        return {n: t.detach() for n, t in self.factors.items()}

    def publish(self, version: int, wait_s: float | None = None) -> RefitOutcome | None:
        """The factors hold `version` of the adapter now: announce it (a refit may move it). With
        `wait_s`, block until every generator serves it, or raise RefitFailed naming the refit,
        member and reason syncd recorded (`syncd.member.refit_outcomes`), and return the refit."""
        with self.lock:
            self.version = parse_weight_version(version)
        self.membership.client.announce_version(self.version)
        return None if wait_s is None else wait_served(self.membership.client, self.version, wait_s)

    def close(self) -> None:
        self.membership.close()


_PEFT_PREFIX = "base_model.model."
# `<module>.lora_A[.<adapter>][.weight]`: PEFT's names (`...q_proj.lora_A.default.weight`), modules
# holding one adapter's factors as linears (`...q_proj.lora_A.weight`) or as parameters (`...lora_A`).
_FACTOR = re.compile(
    r"(?P<module>.+)\.(?P<factor>lora_A|lora_B)(?:\.(?P<adapter>(?!weight$)[^.]+))?(?:\.weight)?"
)


def lora_factors(model: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The LoRA factors of `model` in syncd's names (`model.layers.0.self_attn.q_proj.lora_A.weight`),
    as its live parameters' data (no copy). `adapter`: which of PEFT's named adapters; modules that
    name none hold one. Raises ValueError when the model holds no such factors."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        m = _FACTOR.fullmatch(name.removeprefix(_PEFT_PREFIX))
        if m is not None and m["adapter"] in (None, adapter):
            out[f"{m['module']}.{m['factor']}.weight"] = param.data
    if not out:
        raise ValueError(f"the model holds no LoRA factors of adapter {adapter!r} (<module>.lora_A / lora_B)")
    return out


def adapter_catalog(factors: Mapping[str, torch.Tensor]) -> Catalog:
    """Whole factors as canonical tensors of their own names and dtypes."""
    canonical = tuple(
        CanonicalTensor(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for n, t in sorted(factors.items())
    )
    return Catalog(canonical, tuple(local_tensor(c.name, c.dtype, Canon(c.name, c.shape)) for c in canonical))


def attach_adapter(
    syncd: str,
    name: str,
    factors: Mapping[str, torch.Tensor],
    *,
    alpha: float,
    target_modules: tuple[str, ...],
    auth_token: str | None = None,
    run_id: str | None = None,
    data_host: str = "127.0.0.1",
) -> AdapterSender:
    """Register adapter `name`'s trainer with syncd at `syncd` (host:port of its gRPC server);
    returns at once (`sender.membership.client.wait_registered`). Raises ValueError naming a
    factor that is not one, or a name requests could not ask for."""
    catalog = adapter_catalog(factors)
    spec = AdapterSpec(name, adapter_rank(catalog), alpha, tuple(target_modules))
    spec.validate()
    if any(not t.is_contiguous() for t in factors.values()):
        raise ValueError("adapter factors must be contiguous: syncd reads them in place")
    sender = AdapterSender(spec, factors)
    member_id = "adapter-" + re.sub(r"[^a-z0-9.-]", "-", name.lower()) + "-0"
    sender.membership = join(
        syncd,
        SenderEndpoint(member_id, sender, sender.views),
        role=Role.TRAINER,
        member_id=member_id,
        coords={"pp": 0},
        catalog=catalog,
        data_host=data_host,
        auth_token=auth_token,
        run_id=run_id if run_id is not None else uuid.uuid4().hex,
        adapter=spec,
    )
    return sender
