"""The float64 oracle of the KV-cache pieces against direct formulas: ``reference.append_kv``,
``reference.apply_rotary`` and ``reference.kvcache_decode`` (flash_attn_with_kvcache)."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import reference as ref


def _rope_torch_style(x, cos, sin, interleaved):
    """flash-attn's ``apply_rotary_emb_torch`` in NumPy (``x * cos + rotate_half(x) * sin`` on
    the first rotary_dim dims), on our [B, H, N, d] layout with positions 0..N-1."""
    rd = 2 * cos.shape[1]
    n = x.shape[2]
    if interleaved:
        c, s = np.repeat(cos[:n], 2, axis=-1), np.repeat(sin[:n], 2, axis=-1)
        x1, x2 = x[..., 0:rd:2], x[..., 1:rd:2]
        rot = np.stack([-x2, x1], axis=-1).reshape(x[..., :rd].shape)
    else:
        c, s = np.concatenate([cos[:n]] * 2, -1), np.concatenate([sin[:n]] * 2, -1)
        x1, x2 = x[..., :rd // 2], x[..., rd // 2:rd]
        rot = np.concatenate([-x2, x1], axis=-1)
    return np.concatenate([x[..., :rd] * c + rot * s, x[..., rd:]], axis=-1)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_is_flash_attn_formula(rng, interleaved):
    x = rng.standard_normal((2, 3, 5, 8))
    ang = rng.uniform(0, 2 * np.pi, (7, 3))
    cos, sin = np.cos(ang), np.sin(ang)
    got = ref.apply_rotary(x, cos, sin, interleaved=interleaved)
    np.testing.assert_allclose(got, _rope_torch_style(x, cos, sin, interleaved), atol=1e-15)
    # offsets shift the positions: sequence 1 from position 2
    off = ref.apply_rotary(x, cos, sin, interleaved=interleaved, seqlen_offsets=np.array([0, 2]))
    np.testing.assert_allclose(off[1], _rope_torch_style(x[1:], cos[2:], sin[2:],
                                                         interleaved)[0], atol=1e-15)


def test_rotary_depends_on_relative_position_only(rng):
    """RoPE's purpose: q at position p and k at position p' have a dot product that depends on
    p - p' only (angles theta_i * p), and a rotation keeps the norm."""
    d, maxp = 8, 20
    theta = 10000.0 ** (-np.arange(d // 2) / (d // 2))
    ang = np.arange(maxp)[:, None] * theta
    cos, sin = np.cos(ang), np.sin(ang)
    q = rng.standard_normal((1, 1, 1, d))
    k = rng.standard_normal((1, 1, 1, d))
    for interleaved in (False, True):
        def dot(p, pk):
            qr = ref.apply_rotary(q, cos, sin, interleaved=interleaved, seqlen_offsets=p)
            kr = ref.apply_rotary(k, cos, sin, interleaved=interleaved, seqlen_offsets=pk)
            return float((qr * kr).sum())
        assert abs(dot(7, 3) - dot(14, 10)) < 1e-12 and abs(dot(7, 3) - dot(4, 0)) < 1e-12
        assert abs(dot(7, 3) - dot(7, 4)) > 1e-3
        qr = ref.apply_rotary(q, cos, sin, interleaved=interleaved, seqlen_offsets=9)
        assert abs(np.linalg.norm(qr) - np.linalg.norm(q)) < 1e-12


def test_append_kv_reference_by_hand(rng):
    k = rng.standard_normal((5, 2, 3, 4)).astype(np.float32)   # 5 blocks of 3 slots
    v = rng.standard_normal((5, 2, 3, 4)).astype(np.float32)
    kn = rng.standard_normal((1, 2, 2, 4)).astype(np.float32)
    table = np.array([[4, 0, 2]])
    k2, v2, lens = ref.append_kv(k, v, kn, kn + 1, np.array([2]), table)
    assert list(lens) == [4] and k2.dtype == np.float32
    # positions 2 and 3: block 4 slot 2, block 0 slot 0
    np.testing.assert_array_equal(k2[4, :, 2], kn[0, :, 0])
    np.testing.assert_array_equal(k2[0, :, 0], kn[0, :, 1])
    np.testing.assert_array_equal(v2[0, :, 0], kn[0, :, 1] + 1)
    untouched = np.ones(k.shape[:3], bool)
    untouched[4, :, 2] = untouched[0, :, 0] = False
    np.testing.assert_array_equal(k2[untouched], k[untouched])
    # contiguous with cache_batch_idx: row 1 of 3
    kc = rng.standard_normal((3, 2, 4, 4))
    k3, _, _ = ref.append_kv(kc, kc, kn, kn, np.array([1]), cache_batch_idx=np.array([1]))
    np.testing.assert_array_equal(k3[1, :, 1:3], kn[0])
    np.testing.assert_array_equal(np.delete(k3, 1, 0), np.delete(kc, 1, 0))


def test_kvcache_decode_reference_is_the_pieces(rng):
    """kvcache_decode == rotate, append, then plain attention on each sequence's key slice
    [leftpad, L + Nnew) of its cache row (written out here without the helper)."""
    b, bc, h, hkv, nmax, d, nq = 2, 3, 4, 2, 10, 8, 2
    kc = rng.standard_normal((bc, hkv, nmax, d))
    vc = rng.standard_normal((bc, hkv, nmax, d))
    q = rng.standard_normal((b, h, nq, d))
    kn, vn = rng.standard_normal((b, hkv, nq, d)), rng.standard_normal((b, hkv, nq, d))
    ang = rng.uniform(0, 2 * np.pi, (nmax, 2))
    cos, sin = np.cos(ang), np.sin(ang)
    lens, leftpad, cbi = np.array([3, 6]), np.array([1, 0]), np.array([2, 0])
    o, lse, k2, v2 = ref.kvcache_decode(q, kc, vc, lens, k_new=kn, v_new=vn, rotary_cos=cos,
                                        rotary_sin=sin, rotary_interleaved=False,
                                        cache_batch_idx=cbi, cache_leftpad=leftpad, causal=True)
    for s in range(b):
        row, n = cbi[s], lens[s] + nq
        kr = ref.apply_rotary(kn[s:s + 1], cos, sin, seqlen_offsets=lens[s])[0]
        np.testing.assert_allclose(k2[row, :, lens[s]:n], kr, atol=1e-15)
        np.testing.assert_array_equal(v2[row, :, lens[s]:n], vn[s])
        qr = ref.apply_rotary(q[s:s + 1], cos, sin, seqlen_offsets=lens[s])
        want_o, want_lse = ref.attention(qr, k2[row, :, leftpad[s]:n][None],
                                         v2[row, :, leftpad[s]:n][None], causal=True)
        np.testing.assert_allclose(o[s], want_o[0], atol=1e-13)
        np.testing.assert_allclose(lse[s], want_lse[0], atol=1e-13)
    # not causal, no window: every query token is rotated at cache_seqlens[b]
    o_nc, _, _, _ = ref.kvcache_decode(q, kc, vc, lens, k_new=kn, v_new=vn, rotary_cos=cos,
                                       rotary_sin=sin, cache_batch_idx=cbi)
    q_same = np.concatenate([ref.apply_rotary(q[:, :, i:i + 1], cos, sin, interleaved=True,
                                              seqlen_offsets=lens) for i in range(nq)], axis=2)
    kr = ref.apply_rotary(kn, cos, sin, interleaved=True, seqlen_offsets=lens)
    k4, v4, lens4 = ref.append_kv(kc, vc, kr, vn, lens, cache_batch_idx=cbi)
    want = ref.attention(q_same[1:], k4[0:1, :, :lens4[1]], v4[0:1, :, :lens4[1]])[0]
    np.testing.assert_allclose(o_nc[1], want[0], atol=1e-13)
    # without the extras it is paged_decode
    o0, lse0, _, _ = ref.kvcache_decode(q, kc[:b], vc[:b], lens, causal=True)
    po, plse = ref.paged_decode(q, kc[:b], vc[:b], lens, causal=True)
    np.testing.assert_array_equal(o0, po)
    np.testing.assert_array_equal(lse0, plse)
