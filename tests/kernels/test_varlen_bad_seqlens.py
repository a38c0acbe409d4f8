"""Unvalidated cu_seqlens (the device path's default: they are not read on the host) never
send a varlen kernel outside its packed arrays: each sequence's rows are clamped into them
(kernels/core/common.clamp_rows), so a bad table gives wrong rows at worst, never an access
out of bounds.  In the simulator an access past an array is an IndexError, so a kernel that
read or wrote outside would fail here; the clamped sequences give the reference's result for
the clamped rows."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference
from numba_flash.frontend import variants

from helpers import assert_close, assert_scaled_close


def _unread(monkeypatch):
    """Run the varlen ops as on device arrays: cu_seqlens not read or checked on the host."""
    import numba_flash.ops.backward_varlen as bwd
    import numba_flash.ops.forward_varlen as fwd

    for mod in (fwd, bwd, variants):
        monkeypatch.setattr(mod, "reads_seqlens", lambda *a, **k: False)


@pytest.mark.parametrize("bad", [[0, 3, 40], [0, 9, 5], [-4, 3, 5]],
                         ids=["past-end", "backwards", "negative"])
def test_forward_and_backward_stay_inside(rng, monkeypatch, bad):
    q, k, v, do = (rng.standard_normal((5, 2, 8)).astype(np.float32) for _ in range(4))
    cu = np.array(bad, np.int32)
    _unread(monkeypatch)
    o, lse = numba_flash.forward_varlen(q, k, v, cu, cu, max_seqlen_q=40, max_seqlen_k=40,
                                        return_lse=True, validate=False)
    numba_flash.backward_varlen(do, q, k, v, o, lse, cu, cu, max_seqlen_q=40, max_seqlen_k=40,
                                validate=False)
    # the clamped table: [0, min(3, 5)], then [3, 5) (past-end), [9 -> 5, 5) empty ...
    lo = np.clip(cu, 0, 5)
    hi = np.maximum.accumulate(lo)
    want = reference.attention_varlen(q, k, v, hi, hi)
    rows = slice(0, int(hi[-1]))
    assert_close(o[rows], want[0][rows], np.float32)


def test_good_seqlens_unchanged(rng):
    q, k, v, do = (rng.standard_normal((7, 2, 8)).astype(np.float32) for _ in range(4))
    cu = np.array([0, 3, 7], np.int32)
    o, lse = numba_flash.forward_varlen(q, k, v, cu, cu, max_seqlen_q=4, max_seqlen_k=4,
                                        return_lse=True, causal=True)
    want = reference.attention_varlen(q, k, v, cu, cu, causal=True)
    assert_close(o, want[0], np.float32)
    grads = numba_flash.backward_varlen(do, q, k, v, o, lse, cu, cu, max_seqlen_q=4,
                                        max_seqlen_k=4, causal=True)
    for g, w in zip(grads, reference.attention_backward_varlen(do, q, k, v, cu, cu,
                                                                causal=True)):
        assert_scaled_close(g, w, 4e-6)
