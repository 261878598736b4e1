"""The syncd catalog of every rank describes exactly the tensors the rank holds.

A NumPy simulation executes a catalog (for each piece, canonical[canon box] -> local[local box]) and
compares the result bit-exactly with the rank's real parameters, which come from the torch slicing
of `shard_cut` (the same `sharding.PLAN` executed by other code) or from a real
multi-process training run, and assembles all ranks' pieces back into the canonical tensors of the
HF export. A wrong entry of the table itself shows as a layout that no longer trains like one
process (test_layouts) and, for the fused gate/up weight, against the independent
InterleavedShard description below.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from syncd.layout import Box, Canon, Catalog, Concat, InterleavedShard, Shard, Sharded, hf_names, local_tensor
from trainer_svc.canonical import canonical_shapes
from trainer_svc.catalog import build_catalog, layout_expr
from trainer_svc.hf_checkpoint import load_hf
from trainer_svc.parallel_dims import ParallelDims
from trainer_svc.shard_cut import shard_for_rank
from trainer_svc.tiny import TINY_ARGS

ALL_LAYOUTS = [(pp, dp, ep, tp) for pp in (1, 2) for dp in (1, 2) for ep in (1, 2) for tp in (1, 2)]


def simulate_local(catalog: Catalog, canonical: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute the catalog: every local tensor (in its catalog shape) built from canonical boxes."""
    out = {}
    for t in catalog.tensors:
        local = np.full(t.shape, np.nan, dtype=np.float32)
        for p in t.pieces:
            local[p.local.slices()] = canonical[p.canonical][p.canon.slices()].reshape(p.local.shape)
        out[t.name] = local
    return out


def assemble(catalogs: list[Catalog], locals_: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Inverse: write every rank's pieces back into canonical tensors (NaN where nothing landed)."""
    out = {c.name: np.full(c.shape, np.nan, dtype=np.float32) for c in catalogs[0].canonical}
    for catalog, local in zip(catalogs, locals_):
        for t in catalog.tensors:
            view = local[t.name].reshape(t.shape)
            for p in t.pieces:
                out[p.canonical][p.canon.slices()] = view[p.local.slices()].reshape(p.canon.shape)
    return out


def _np(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in tensors.items()}


def gate_up_interleaved_expr(prefix: str, dims: ParallelDims, c) -> Sharded:
    """The fused gate/up weight on its own 2-D shape [E_l*2*I_l, H], written independently of
    `sharding.PLAN`: the concatenation [gate_0; up_0; gate_1; up_1; ...] sharded over ep (whole
    experts), then InterleavedShard over tp with one stripe per local (expert, projection)."""
    E, I, H = TINY_ARGS.num_experts, TINY_ARGS.moe_intermediate_size, TINY_ARGS.hidden_size
    parts = []
    for e in range(E):
        for proj in ("gate_proj", "up_proj"):
            box = Box((e, 0, 0), (e + 1, I, H))
            parts.append(Canon(hf_names.grouped_expert_name(prefix, proj), (E, I, H), box, drop=(0,)))
    placements = (Shard(0), InterleavedShard(0, stripes=E // dims.ep * 2))
    return Sharded(Concat(0, tuple(parts)), placements, (dims.ep, dims.tp), (c.ep, c.tp))


@pytest.mark.parametrize("ep,tp", [(1, 1), (1, 2), (2, 1), (2, 2), (4, 2), (8, 4)])
def test_interleaved_2d_and_4d_view_describe_the_same_elements(ep, tp):
    """Every element of the fused [E_l*2*I_l, H] weight comes from the same canonical element
    under the InterleavedShard description and under the catalog's [E_l, 2, I_l, H] view."""
    dims = ParallelDims(ep=ep, tp=tp)
    E, I, H = TINY_ARGS.num_experts, TINY_ARGS.moe_intermediate_size, TINY_ARGS.hidden_size
    prefix = "model.layers.0.mlp"
    ids = {  # unique id per canonical element
        hf_names.grouped_expert_name(prefix, "gate_proj"): np.arange(E * I * H, dtype=np.float32).reshape(
            E, I, H
        ),
        hf_names.grouped_expert_name(prefix, "up_proj"): -1
        - np.arange(E * I * H, dtype=np.float32).reshape(E, I, H),
    }
    name, shapes = f"{prefix}.experts.gate_up_proj", canonical_shapes(TINY_ARGS)
    for c in dims.all_coords():
        view = local_tensor(name, "float32", layout_expr(name, shapes, dims, c))
        flat = local_tensor(name, "float32", gate_up_interleaved_expr(prefix, dims, c))
        assert view.shape == (E // ep, 2, I // tp, H)
        assert len(view.pieces) == 2
        assert flat.shape == (E // ep * 2 * I // tp, H)
        got_view = simulate_local(Catalog((), (view,)), ids)[view.name]
        got_flat = simulate_local(Catalog((), (flat,)), ids)[flat.name]
        np.testing.assert_array_equal(got_view.reshape(flat.shape), got_flat)
        assert not np.isnan(got_flat).any()


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda l: "pp{}dp{}ep{}tp{}".format(*l))
def test_catalog_matches_loaded_shards_and_reassembles(tiny_dir, layout):
    args, canonical = load_hf(tiny_dir)
    canon_np = _np(canonical)
    dims = ParallelDims(*layout)
    catalogs, locals_ = [], []
    for c in dims.all_coords():
        catalog = build_catalog(args, dims, c)
        sim = simulate_local(catalog, canon_np)
        actual = {
            t.name: shard_for_rank(t.name, canonical, dims, c).view(t.shape).numpy() for t in catalog.tensors
        }
        assert sim.keys() == actual.keys()
        for name in sim:
            np.testing.assert_array_equal(sim[name], actual[name], err_msg=f"rank {c}: {name}")
        catalogs.append(catalog)
        locals_.append(actual)
    rebuilt = assemble(catalogs, locals_)
    for name, want in canon_np.items():
        np.testing.assert_array_equal(rebuilt[name], want, err_msg=name)


@pytest.mark.parametrize("layout", [(2, 1, 2, 2), (1, 2, 2, 1)], ids=["pp2dp1ep2tp2", "pp1dp2ep2tp1"])
def test_catalog_after_training_matches_rank_params_and_export(run_layout, layout):
    """After a real multi-process run: the catalog executed on the exported checkpoint gives every
    rank's trained parameters bit-exactly, and all ranks' pieces assemble into the export."""
    ranks, export = run_layout(*layout)
    exported = hf_names.group_from_hf(load_file(str(export / "model.safetensors")).items(), torch.stack)
    canon_np = _np(exported)
    dims = ParallelDims(*layout)
    catalogs, locals_ = [], []
    for r, out in enumerate(ranks):
        c = dims.coords(r)
        assert out.coords == c.as_dict()
        catalog = build_catalog(TINY_ARGS, dims, c)
        sim = simulate_local(catalog, canon_np)
        actual = {t.name: out.params[t.name].view(t.shape).numpy() for t in catalog.tensors}
        assert sim.keys() == set(out.params), "catalog must list exactly the rank's parameters"
        for name in sim:
            np.testing.assert_array_equal(sim[name], actual[name], err_msg=f"rank {r}: {name}")
        catalogs.append(catalog)
        locals_.append(actual)
    rebuilt = assemble(catalogs, locals_)
    for name, want in canon_np.items():
        np.testing.assert_array_equal(rebuilt[name], want, err_msg=name)


def test_data_parallel_replicas_share_one_catalog():
    dims = ParallelDims(pp=1, dp=2, ep=2, tp=2)
    hashes = {}
    for c in dims.all_coords():
        hashes.setdefault((c.ep, c.tp), set()).add(build_catalog(TINY_ARGS, dims, c).content_hash)
    assert all(len(h) == 1 for h in hashes.values())
    assert len({next(iter(h)) for h in hashes.values()}) == 4


def test_catalog_declares_every_canonical_tensor():
    catalog = build_catalog(TINY_ARGS, ParallelDims(), ParallelDims().coords(0))
    assert {c.name: c.shape for c in catalog.canonical} == canonical_shapes(TINY_ARGS)
    assert catalog.nbytes == 4 * sum(int(np.prod(s)) for s in canonical_shapes(TINY_ARGS).values())
