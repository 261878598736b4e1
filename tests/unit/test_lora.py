"""LoRA's pieces that need no processes: the merge arithmetic is the same bits on any shard of a
weight as on the whole, a trainer's adapters reassemble from its export into a reference merge
equal to the weights it serves, and a partial trainer's refit plans only what it declares."""

from __future__ import annotations

import pytest
import torch

from generator_svc.worker.staging import Staging
from syncd.layout import Canon, CanonicalTensor, Catalog, Replicate, Sharded, local_tensor
from syncd.plan import DestMember, SourceMember, make_plan
from trainer_svc.catalog import build_catalog
from trainer_svc.hf_checkpoint import load_hf
from trainer_svc.lora import merge_lora
from trainer_svc.lora.checkpoint import load_adapter, merge_checkpoint
from trainer_svc.settings import LaunchEnv, TrainSettings
from trainer_svc.tiny import make_tiny_checkpoint
from trainer_svc.train import Trainer


def test_a_merge_of_shards_is_the_merge_of_the_whole_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    w, a, b = (
        torch.randn(96, 80, generator=gen),
        torch.randn(8, 80, generator=gen),
        torch.randn(96, 8, generator=gen),
    )
    whole = merge_lora(w, a, b, 2.0, torch.bfloat16)
    rows = torch.cat([merge_lora(w[i : i + 32], a, b[i : i + 32], 2.0, torch.bfloat16) for i in (0, 32, 64)])
    cols = torch.cat(
        [merge_lora(w[:, j : j + 40], a[:, j : j + 40], b, 2.0, torch.bfloat16) for j in (0, 40)], 1
    )
    assert torch.equal(rows, whole) and torch.equal(cols, whole)
    # rounded once, from float32: within half a bfloat16 ulp of the float32 merge
    exact = w + (b @ a) * 2.0
    assert torch.allclose(whole.float(), exact, rtol=2**-8, atol=1e-6)


def test_a_lora_trainer_freezes_the_base_and_exports_what_a_reference_merge_makes(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "base")
    settings = TrainSettings(
        model_dir=str(model), steps=1, lora_rank=4, dtype="bfloat16", lr=3e-3, device="cpu",
    )  # fmt: skip
    trainer = Trainer.create(settings, LaunchEnv(0, 1, 0), torch.device("cpu"))
    assert trainer.lora is not None
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.fit()
    assert all(torch.equal(p.detach(), frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen)
    trainer.export(str(tmp_path / "export"))

    reference = merge_checkpoint(load_hf(model)[1], load_adapter(tmp_path / "export"), torch.bfloat16)
    exported = load_hf(tmp_path / "export")[1]
    base = load_hf(model)[1]
    assert all(torch.equal(reference[n].to(torch.bfloat16).float(), exported[n].float()) for n in reference)
    changed = {
        n for n in reference if not torch.equal(exported[n].float(), base[n].to(torch.bfloat16).float())
    }
    assert changed == set(load_adapter(tmp_path / "export").targets())
    catalog = trainer.lora.refit_catalog(
        build_catalog(trainer.args, trainer.mesh.dims, trainer.mesh.coords, "bfloat16")
    )
    assert catalog.partial and {c.name for c in catalog.canonical} == changed


def _catalog(names: list[str], *, partial: bool = False) -> Catalog:
    canon = tuple(CanonicalTensor(n, (4, 4), "float32") for n in names)
    tensors = tuple(
        local_tensor(n, "float32", Sharded(Canon(n, (4, 4)), (Replicate(),), (1,), (0,))) for n in names
    )
    return Catalog(canon, tensors, partial=partial)


def test_a_partial_source_plans_only_what_it_declares_and_a_full_one_still_must_hold_everything():
    generator = DestMember("g", _catalog(["l0.qkv.weight", "l0.norm.weight", "l1.qkv.weight"]))
    plan = make_plan([SourceMember("t", 0, _catalog(["l0.qkv.weight"], partial=True))], [generator])
    assert {u.canonical for b in plan.buckets for u in b.units} == {"l0.qkv.weight"}
    with pytest.raises(ValueError, match=r"no source holds canonical tensor l0\.norm\.weight"):
        make_plan([SourceMember("t", 0, _catalog(["l0.qkv.weight"]))], [generator])
    assert _catalog(["a"], partial=True).content_hash != _catalog(["a"]).content_hash


def test_staging_of_a_partial_refit_checks_and_installs_only_its_layers_and_refuses_half_a_layer():
    staging = Staging(_catalog(["l0.experts.w13", "l0.experts.w2", "l0.norm.weight"]))
    staging.begin("r1", frozenset({"l0.experts.w13", "l0.experts.w2"}))
    assert staging.changed == {"l0.experts.w13", "l0.experts.w2"}
    assert [m.split(" ")[0] for m in staging.missing()] == ["l0.experts.w13", "l0.experts.w2"]
    with pytest.raises(ValueError, match=r"only part of layer l0.experts: not \['l0.experts.w2'\]"):
        staging.begin("r2", frozenset({"l0.experts.w13"}))
    staging.begin("r3", frozenset({"l0.experts.w13", "l0.experts.w2", "l0.norm.weight"}))
    assert staging.changed is None  # a full refit
