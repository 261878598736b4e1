"""`Selection`: a rank's per-dim index runs, as given, select boxes of a layout expression.

Property test against NumPy: random shapes, random runs (any order, any gaps, as `_StridedShard`
interleaves them), over a plain canonical tensor and over a fusion of two (`Concat`); every piece
must hold, at its local box, exactly the canonical values at its canonical box, and the pieces must
tile the local tensor once."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from syncd.layout import Canon, Concat
from syncd.layout.selection import Selection


@st.composite
def runs_of(draw, n: int):
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=4))) if n > 1 else []
    bounds = [0, *cuts, n]
    runs = list(itertools.pairwise(bounds))
    kept = draw(st.lists(st.sampled_from(runs), min_size=1, max_size=len(runs), unique=True))
    return tuple(kept)  # drawn order: local order need not be global order


@st.composite
def cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    fused = draw(st.booleans()) and shape[0] >= 2
    runs = tuple(draw(runs_of(n)) for n in shape)
    return shape, fused, runs


@settings(max_examples=200, deadline=None)
@given(cases())
def test_selection_pieces_hold_the_selected_values(case):
    shape, fused, runs = case
    rng = np.random.default_rng(0)
    if fused:  # rows [0, k) of tensor a, [k, n) of tensor b
        k = shape[0] // 2
        a = rng.standard_normal((k, *shape[1:]))
        b = rng.standard_normal((shape[0] - k, *shape[1:]))
        expr = Concat(0, (Canon("a", a.shape), Canon("b", b.shape)))
        canonical, whole = {"a": a, "b": b}, np.concatenate([a, b])
    else:
        whole = rng.standard_normal(shape)
        expr, canonical = Canon("t", shape), {"t": whole}
    index = [np.concatenate([np.arange(lo, hi) for lo, hi in r]) for r in runs]
    local = whole[np.ix_(*index)]
    selection = Selection.of(expr, runs)
    assert selection.shape == local.shape
    written = np.zeros(local.shape, dtype=int)
    for p in selection.pieces():
        assert np.array_equal(local[p.local.slices()], canonical[p.canonical][p.canon.slices()])
        written[p.local.slices()] += 1
    assert (written == 1).all()


def test_selection_refuses_runs_outside_the_expression():
    with pytest.raises(ValueError, match=r"dim 0: runs \(\(2, 5\),\) are empty or outside \[0, 4\)"):
        Selection.of(Canon("t", (4,)), (((2, 5),),))
