"""The source notes' code, transcribed to Python as written (bugs included), and the demos that
show each bug on a concrete input.  ``tests/docs/test_notes_code.py`` checks every claim made
here; the pages (online-softmax, merge-states, paged-attention, naive-forward, grid,
loop-order) quote the output of::

    python docs/examples/notes_code.py online-softmax
    python docs/examples/notes_code.py merge
    python docs/examples/notes_code.py paged
    python docs/examples/notes_code.py triton       # question 8
    python docs/examples/notes_code.py batch        # question 9
    python docs/examples/notes_code.py loop-order   # question 10
    python docs/examples/notes_code.py triton-dot   # question 8: tl.dot's dtype and size rules
    python docs/examples/notes_code.py stats-dtype  # questions 3, 5, 6: l, m, O in float16
    python docs/examples/notes_code.py lse          # question 6: l and m, not the lse
    python docs/examples/notes_code.py merge-maxima # question 13: sums against other maxima
    python docs/examples/notes_code.py decode-io    # question 2: "in decode N is small"
    python docs/examples/notes_code.py strides      # question 9.1: K/V offsets from Q's strides
    python docs/examples/notes_code.py paged-init   # question 12: float m_s[Br] = {-inf};
"""

from __future__ import annotations

import math
import sys

import numpy as np

from numba_flash import reference as ref
from report import err


# [docs:notes-online-softmax]
def notes_online_softmax(x):
    """The notes' "one-pass" softmax, transcribed line for line (comments translated)."""
    m = -float("inf")  # current maximum
    l = 0.0  # sum of exponentials (relative to the current m)
    out = [0.0] * len(x)

    for i, val in enumerate(x):
        if val > m:
            # new maximum found: rescale the old l
            l += math.exp(m - val)  # m is the old maximum, val the new one
            m = val
        # add the current element's exponential relative to the current m
        l += math.exp(val - m)
        out[i] = math.exp(val - m)  # keep the unnormalised value

    # normalise
    for i in range(len(x)):
        out[i] /= l
    return out
# [/docs:notes-online-softmax]


# [docs:notes-fixed-l-only]
def notes_online_softmax_fixed_l(x):
    """The notes' code with the first bug fixed (``l *= ...``); the stale ``out`` remains."""
    m = -float("inf")
    l = 0.0
    out = [0.0] * len(x)
    for i, val in enumerate(x):
        if val > m:
            l *= math.exp(m - val)  # fixed: every old term was taken against the old m
            m = val
        l += math.exp(val - m)
        out[i] = math.exp(val - m)  # still taken against the max seen *so far*
    for i in range(len(x)):
        out[i] /= l
    return out
# [/docs:notes-fixed-l-only]


# [docs:notes-merge]
def notes_wrong_merge(blocks):  # always uses the first block's maximum
    m = blocks[0]["m"]
    l = blocks[0]["l"]
    o = blocks[0]["o"]
    for b in blocks[1]:
        # wrong: m is never updated, the old m is used for the new block
        l += b["l"] * np.exp(b["m"] - m)
        o += b["o"] * np.exp(b["m"] - m)
    return o / l


def notes_correct_merge(blocks):
    m = -np.inf
    l = 0.0
    o = 0.0
    for b in blocks:
        m_new = max(m, b["m"])
        l = l * np.exp(m - m_new) + b["l"] * np.exp(b["m"] - m_new)
        o = o * np.exp(m - m_new) + b["o"] * np.exp(b["m"] - m_new)
        m = m_new
    return o / l
# [/docs:notes-merge]


# [docs:notes-merge-slice-fixed]
def notes_wrong_merge_sliced(blocks):
    """``notes_wrong_merge`` with only the loop fixed to ``blocks[1:]``: still the first max."""
    m = blocks[0]["m"]
    l = blocks[0]["l"]
    o = blocks[0]["o"]
    for b in blocks[1:]:
        l += b["l"] * np.exp(b["m"] - m)
        o += b["o"] * np.exp(b["m"] - m)
    return o / l
# [/docs:notes-merge-slice-fixed]


# [docs:notes-paged]
def c_ceil_of_int_division(a, b):
    """``ceil(seq_len / block_size)`` as C evaluates it on two ints: the division truncates
    first."""
    return math.ceil(a // b)


def notes_paged_attention(Q, block_table, kv_cache, seq_len, block_size, head, scale,
                          count_blocks=c_ceil_of_int_division, store_max=False, bound_sum=False,
                          c_init=False):
    """The notes' ``flash_paged_attention_kernel`` for one Q block (rows ``0 .. Br-1``), one
    head, transcribed statement by statement; ``kv_cache`` is ``[2, num_blocks, heads,
    block_size, d]`` as in the notes.  Returns ``O[q_start:q_end]``.  The three keyword arguments
    switch on the fixes: ``count_blocks=ceil_div``, ``store_max=True``, ``bound_sum=True``.

    ``float S[Br][block_size]`` is written only in its first ``valid_tokens`` columns; the rest
    is undefined in C and in practice holds what the previous block left there, which is what
    ``S`` (one array for the whole loop) models.

    ``float m_s[Br] = {-inf};`` sets only ``m_s[0]`` in C (an initialiser shorter than the array
    zero-fills the rest); ``np.full`` sets every element.  ``c_init=True`` models C's reading."""
    Br, head_dim = Q.shape
    q_start, q_end = 0, min(Br, seq_len)
    Q_s = Q[q_start:q_end]
    O_s = np.zeros((Br, head_dim))
    l_s = np.zeros(Br)
    m_s = np.full(Br, -np.inf)  # float m_s[Br] = {-inf};
    if c_init:
        m_s[1:] = 0.0  # ... as C reads it: {-inf, 0, 0, ...}
    S = np.zeros((q_end - q_start, block_size))  # float S[Br][block_size]
    num_logic_blocks = count_blocks(seq_len, block_size)
    for lb in range(num_logic_blocks):
        phy_idx = block_table[lb]
        if phy_idx < 0:
            continue  # "unallocated: skip"
        k_start = lb * block_size
        k_end = min(k_start + block_size, seq_len)
        valid_tokens = k_end - k_start
        K_s = kv_cache[0, phy_idx, head, :valid_tokens]
        V_s = kv_cache[1, phy_idx, head, :valid_tokens]
        S[:, :valid_tokens] = (Q_s @ K_s.T) * scale  # "only for the valid tokens"
        n_sum = valid_tokens if bound_sum else block_size
        for r in range(q_end - q_start):
            row_max = S[r, :valid_tokens].max()  # max(S[r][0..valid_tokens])
            m_new = max(m_s[r], row_max)
            factor = math.exp(m_s[r] - m_new)
            l_s[r] = l_s[r] * factor + np.exp(S[r, :n_sum] - m_new).sum()  # sum(exp(S[r] - m_new))
            O_s[r] = O_s[r] * factor + np.exp(S[r, :valid_tokens] - m_new) @ V_s
            if store_max:
                m_s[r] = m_new  # missing in the notes: m_s[r] stays -inf, so factor is always 0
    return O_s[: q_end - q_start] / l_s[: q_end - q_start, None]
# [/docs:notes-paged]


def ceil_div(a, b):
    return -(-a // b)


def paged_example(rng, seq_len, scale, block_size=4, d=4, n_blocks=8, heads=2, head=1):
    """A random one-sequence paged cache (the notes' layout) with a scrambled block table, and
    the float64 attention of ``Q`` over the sequence's ``seq_len`` keys:
    ``(Q, table, kv, want)``."""
    kv_cache = rng.standard_normal((2, n_blocks, heads, block_size, d))
    table = rng.permutation(n_blocks)[: ceil_div(seq_len, block_size)]
    Q = rng.standard_normal((seq_len, d))
    K, V = (np.concatenate([kv_cache[i, pb, head] for pb in table])[:seq_len] for i in (0, 1))
    want = ref.attention(Q[None, None], K[None, None], V[None, None], softmax_scale=scale)[0]
    return Q, table, kv_cache, want[0, 0]


def demo_paged():
    rng = np.random.default_rng(0)
    scale = 0.5
    print("the notes' paged kernel, one head, all rows in one Q block, block_size = 4; max |O -")
    print("attention over all seq_len keys| (non-causal: the notes leave the mask out):")
    for seq_len in (12, 10):
        Q, table, kv, want = paged_example(rng, seq_len, scale)
        for count, store, bound, label in (
                (c_ceil_of_int_division, False, False, "as written"),
                (c_ceil_of_int_division, True, False, "+ m_s[r] = m_new"),
                (ceil_div, True, False, "+ ceil_div(seq_len, block_size)"),
                (ceil_div, True, True, "+ sum over valid_tokens only")):
            got = notes_paged_attention(Q, table, kv, seq_len, 4, 1, scale, count, store, bound)
            print(f"  seq_len={seq_len:2d} ({count(seq_len, 4)} blocks read) {label:32s}"
                  f" {err(np.abs(got - want).max(), 8)}")
    Q, table, kv, want = paged_example(rng, 12, scale)
    bad = table.copy()
    bad[1] = -1
    got = notes_paged_attention(Q, bad, kv, 12, 4, 1, scale, ceil_div, True, True)
    print(f"  seq_len=12, block_table = {bad.tolist()}, all fixes: no error, all finite "
          f"{bool(np.isfinite(got).all())},")
    print(f"  max |O - attention| {np.abs(got - want).max():.2e} (keys 4..7 silently dropped)")


def demo_paged_init():
    rng = np.random.default_rng(0)
    scale = 0.5
    print("the notes' paged kernel with its three fixes, seq_len = 12, Br = 12 rows; m_s as")
    print("np.full sets it ({-inf, -inf, ...}) and as C sets it ({-inf, 0, 0, ...}):")
    for label, negative in (("scores ~ N(0, 1)", False), ("every score below -1000", True)):
        Q, table, kv, _ = paged_example(rng, 12, scale)
        if negative:  # keys with entries >= 1, queries <= -500
            kv = kv.copy()
            kv[0] = np.abs(kv[0]) + 1.0
            Q = -np.abs(Q) - 500.0
        K = np.concatenate([kv[0, pb, 1] for pb in table])[:12]
        V = np.concatenate([kv[1, pb, 1] for pb in table])[:12]
        want = ref.attention(Q[None, None], K[None, None], V[None, None], softmax_scale=scale)[0]
        want = want[0, 0]
        smax = (Q @ K.T * scale).max()
        for init, c_init in (("np.full", False), ("C's {-inf}", True)):
            with np.errstate(invalid="ignore"):
                got = notes_paged_attention(Q, table, kv, 12, 4, 1, scale, ceil_div, True, True,
                                            c_init=c_init)
            nan_rows = np.flatnonzero(np.isnan(got).any(axis=1))
            ok = np.flatnonzero(~np.isnan(got).any(axis=1))
            e = np.abs(got[ok] - want[ok]).max() if ok.size else float("nan")
            rows = (f"rows {nan_rows[0]}..{nan_rows[-1]} NaN" if nan_rows.size else "no NaN")
            print(f"  {label:23s} (max score {smax:8.1f}) {init:10s} {rows:16s} "
                  f"other rows max |O - ref| {err(e)}")


# -- question 8: the notes' Triton kernel, on a NumPy stand-in of triton.language -------------
class _Pointer:
    """A block of pointers, as Triton builds them: a flat array plus integer offsets."""

    def __init__(self, base, offsets=0):
        self.base, self.offsets = base, np.asarray(offsets)

    def __add__(self, offsets):
        return _Pointer(self.base, self.offsets + np.asarray(offsets))


class TritonStandIn:
    """The few ``triton.language`` calls the notes' kernel makes, in NumPy, with Triton's own
    signatures and its one shape rule that matters here (Triton 3.x,
    ``python/triton/language/standard.py`` and ``semantic.py``):

    * ``max(input, axis=None, return_indices=False, return_indices_tie_break_left=True,
      keep_dims=False)`` and ``sum(input, axis=None, keep_dims=False, ...)``: the keyword is
      ``keep_dims`` (PyTorch's is ``keepdim``, NumPy's ``keepdims``);
    * ``store(pointer, value, mask)`` broadcasts ``value`` to the pointer block's shape with
      ``broadcast_impl_shape``, which raises ``ValueError("Cannot broadcast, rank mismatch:
      {src_shape}, {shape}")`` when the ranks differ: no silent squeeze of a ``[BQ, 1]`` value into
      a ``[BQ]`` pointer block.

    Loads and stores outside the array raise IndexError (a memory fault on a GPU) unless masked."""

    float32 = np.float32

    def __init__(self, pid=0):
        self.pid = pid

    def program_id(self, axis):
        return self.pid

    arange = staticmethod(lambda start, end: np.arange(start, end))
    zeros = staticmethod(lambda shape, dtype: np.zeros(shape, dtype))
    full = staticmethod(lambda shape, value, dtype: np.full(shape, value, dtype))
    exp = staticmethod(np.exp)
    maximum = staticmethod(np.maximum)
    dot = staticmethod(lambda a, b: a @ b)

    @staticmethod
    def max(input, axis=None, return_indices=False, return_indices_tie_break_left=True,
            keep_dims=False):
        return np.max(input, axis=axis, keepdims=keep_dims)

    @staticmethod
    def sum(input, axis=None, keep_dims=False, dtype=None):
        return np.sum(input, axis=axis, keepdims=keep_dims)

    @staticmethod
    def load(pointer, mask=None, other=0.0):
        off = pointer.offsets
        mask = np.ones(off.shape, bool) if mask is None else np.broadcast_to(mask, off.shape)
        if (off[mask] >= pointer.base.size).any() or (off[mask] < 0).any():
            raise IndexError("unmasked load outside the array")
        return np.where(mask, pointer.base[np.where(mask, off, 0)], other)

    @staticmethod
    def store(pointer, value, mask=None):
        off = pointer.offsets
        value = np.asarray(value)
        if value.ndim and value.ndim != off.ndim:  # semantic.broadcast_impl_shape
            raise ValueError(f"Cannot broadcast, rank mismatch: {list(value.shape)}, "
                             f"{list(off.shape)}")
        value = np.broadcast_to(value, off.shape)
        mask = np.ones(off.shape, bool) if mask is None else np.broadcast_to(mask, off.shape)
        if (off[mask] >= pointer.base.size).any():
            raise IndexError("unmasked store outside the array")
        pointer.base[off[mask]] = value[mask]


class StrictDotStandIn(TritonStandIn):
    """:class:`TritonStandIn` whose ``dot`` also checks the two rules of Triton's
    ``semantic.dot`` that the plain ``a @ b`` hides (quoted from Triton 3.x):

    * ``assert lhs.dtype == rhs.dtype, f"Both operands must be same dtype. Got {lhs.dtype} and
      {rhs.dtype}"`` (for every non-fp8 pair);
    * ``assert lhs.shape[-2] >= min_dot_size[0] and lhs.shape[-1] >= min_dot_size[2] and
      rhs.shape[-1] >= min_dot_size[1], f"Input shapes should have M >= ..., N >= ... and K >=
      ..."``, with the NVIDIA backend's ``min_dot_size``: (16, 16, 16) for 16- and 32-bit
      operands in Triton 3.0-3.2; newer releases pad small M and N and keep K >= 16 (16-bit),
      K >= 8 (32-bit), K >= 4 (64-bit).  ``min_dot`` picks the rule (default: the older one).

    The product of two float16 blocks is float32 (``out_dtype=tl.float32``), as in Triton."""

    float16 = np.float16
    NAMES = {np.dtype(np.float16): "fp16", np.dtype(np.float32): "fp32",
             np.dtype(np.float64): "fp64"}

    def __init__(self, pid=0, min_dot="triton<=3.2"):
        super().__init__(pid)
        self.min_dot = min_dot

    def min_dot_size(self, dtype):
        if self.min_dot == "triton<=3.2":
            return (16, 16, 16)
        return (1, 1, {2: 16, 4: 8, 8: 4}[np.dtype(dtype).itemsize])

    def dot(self, a, b):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype != b.dtype:
            raise AssertionError(f"Both operands must be same dtype. Got {self.NAMES[a.dtype]} "
                                 f"and {self.NAMES[b.dtype]}")
        mm, nn, kk = self.min_dot_size(a.dtype)
        if not (a.shape[-2] >= mm and a.shape[-1] >= kk and b.shape[-1] >= nn):
            raise AssertionError(f"Input shapes should have M >= {mm}, N >= {nn} and K >= {kk}")
        out = np.float64 if a.dtype == np.float64 else np.float32
        return a.astype(out) @ b.astype(out)


TritonStandIn.max.__qualname__ = "max"  # as Triton's own function names itself in errors
TritonStandIn.sum.__qualname__ = "sum"


# [docs:notes-triton]
def notes_triton_forward(tl, Q_ptr, K_ptr, V_ptr, O_ptr, L_ptr, M_ptr, N, d, Br, Bc, scale,
                         stride_q_n, stride_k_n, stride_v_n, stride_o_n,
                         BLOCK_Q, BLOCK_KV, D, keep="keepdim", stats_1d=False, p_cast=False):
    """The notes' ``_flash_attention_fwd_kernel`` (question 8) statement by statement, for the
    program ``tl.program_id(0)``.  ``keep="keep_dims"``, ``stats_1d=True`` and ``p_cast=True``
    switch on the fixes (Triton's keyword; ``l`` and ``m`` stored as ``[BLOCK_Q]``; ``P`` cast
    to ``V``'s dtype before ``tl.dot``)."""
    pid = tl.program_id(0)
    q_start = pid * BLOCK_Q
    if q_start >= N:
        return
    offs_q = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, D)
    Q = tl.load(Q_ptr + (q_start + offs_q[:, None]) * stride_q_n + offs_d[None, :],
                mask=(q_start + offs_q[:, None]) < N, other=0.0)
    O = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
    l = tl.zeros([BLOCK_Q, 1], dtype=tl.float32)
    m = tl.full([BLOCK_Q, 1], float('-inf'), dtype=tl.float32)
    Tc = (N + BLOCK_KV - 1) // BLOCK_KV
    for j in range(Tc):
        k_start = j * BLOCK_KV
        offs_kv = tl.arange(0, BLOCK_KV)
        K = tl.load(K_ptr + (k_start + offs_kv[:, None]) * stride_k_n + offs_d[None, :],
                    mask=(k_start + offs_kv[:, None]) < N, other=0.0)
        V = tl.load(V_ptr + (k_start + offs_kv[:, None]) * stride_v_n + offs_d[None, :],
                    mask=(k_start + offs_kv[:, None]) < N, other=0.0)
        S = tl.dot(Q, K.T) * scale
        m_new = tl.maximum(m, tl.max(S, axis=1, **{keep: True}))
        O = O * tl.exp(m - m_new)
        l = l * tl.exp(m - m_new)
        P = tl.exp(S - m_new)
        l = l + tl.sum(P, axis=1, **{keep: True})
        if p_cast:  # the fix: tl.dot takes two operands of one dtype (in Triton: P.to(V.dtype))
            P = P.astype(V.dtype)
        O = O + tl.dot(P, V)
        m = m_new
    O = O / l
    tl.store(O_ptr + (q_start + offs_q[:, None]) * stride_o_n + offs_d[None, :], O,
             mask=(q_start + offs_q[:, None]) < N)
    if stats_1d:  # the fix: a [BLOCK_Q] value for a [BLOCK_Q] pointer block
        l, m = l[:, 0], m[:, 0]  # in Triton: tl.reshape(l, [BLOCK_Q]), or keep l, m 1-D
    tl.store(L_ptr + (q_start + offs_q), l, mask=(q_start + offs_q) < N)
    tl.store(M_ptr + (q_start + offs_q), m, mask=(q_start + offs_q) < N)
# [/docs:notes-triton]


def run_notes_triton(q, k, v, block=4, stand_in=TritonStandIn, **fixes):
    """Launch :func:`notes_triton_forward` over its grid ``(cdiv(N, BLOCK_Q),)`` for one head
    ``q, k, v [N, D]``; return ``(O, L, M)`` (NaN where nothing was written)."""
    n, dd = q.shape
    o = np.full(n * dd, np.nan)
    l_out = np.full(n, np.nan)
    m_out = np.full(n, np.nan)
    for pid in range(ceil_div(n, block)):
        notes_triton_forward(stand_in(pid), _Pointer(q.ravel()), _Pointer(k.ravel()),
                             _Pointer(v.ravel()), _Pointer(o), _Pointer(l_out), _Pointer(m_out),
                             n, dd, block, block, 1 / math.sqrt(dd), dd, dd, dd, dd,
                             block, block, dd, **fixes)
    return o.reshape(n, dd), l_out, m_out


def demo_triton():
    rng = np.random.default_rng(0)
    print("the notes' Triton kernel (question 8) on a NumPy stand-in of triton.language,")
    print("one head, D = 4, BLOCK_Q = BLOCK_KV = 4:")
    for n in (12, 10):
        q, k, v = (rng.standard_normal((n, 4)) for _ in range(3))
        want, lse = ref.attention(q[None, None], k[None, None], v[None, None])
        want, lse = want[0, 0], lse[0, 0]
        for label, fixes in (("as written", {}),
                             ("+ keep_dims=True", {"keep": "keep_dims"}),
                             ("+ l, m stored as [BLOCK_Q]", {"keep": "keep_dims",
                                                             "stats_1d": True})):
            try:
                o, l_out, m_out = run_notes_triton(q, k, v, **fixes)
            except (TypeError, ValueError) as exc:
                print(f"  N={n:2d} {label:28s} {type(exc).__name__}: {exc}")
                continue
            print(f"  N={n:2d} {label:28s} max |O - attention| {err(np.abs(o - want).max())},"
                  f" max |M + log L - lse| {err(np.abs(m_out + np.log(l_out) - lse).max())}")


# -- question 9: the batched wrapper ---------------------------------------------------------
# [docs:notes-forward-q3]
def notes_flash_attention_forward(Q, K, V, Br, Bc):
    """The notes' question-3.1 ``flash_attention_forward`` in NumPy: one head, returns only O."""
    N, d = Q.shape
    scale = 1.0 / math.sqrt(d)
    O = np.zeros_like(Q)
    L = np.zeros((N, 1))
    m = np.full((N, 1), -np.inf)
    Tr = (N + Br - 1) // Br
    Tc = (N + Bc - 1) // Bc
    for i in range(Tr):
        q_start = i * Br
        q_end = min(N, q_start + Br)
        Qi = Q[q_start:q_end]
        Oi, mi, li = O[q_start:q_end], m[q_start:q_end], L[q_start:q_end]
        for j in range(Tc):
            k_start = j * Bc
            k_end = min(N, k_start + Bc)
            Kj, Vj = K[k_start:k_end], V[k_start:k_end]
            Sij = Qi @ Kj.T * scale
            mi_new = np.maximum(mi, Sij.max(axis=1, keepdims=True))
            Oi = Oi * np.exp(mi - mi_new)
            li = li * np.exp(mi - mi_new)
            Pij = np.exp(Sij - mi_new)
            li = li + Pij.sum(axis=1, keepdims=True)
            Oi = Oi + Pij @ Vj
            mi = mi_new
        O[q_start:q_end] = Oi / li
        L[q_start:q_end] = li
        m[q_start:q_end] = mi
    return O
# [/docs:notes-forward-q3]


# -- question 3.1's comment: "Oi = O[q_start:q_end]  # a reference, modified directly" ----------
def notes_q31_trusting_the_comment(Q, K, V, Br, Bc):
    """Question 3.1's loop as its comment describes it: ``Oi``, ``mi``, ``li`` taken as views of
    ``O``, ``m``, ``L`` ("a reference, modified directly") and the three write-back lines left
    out.  Returns ``(O, shares)``: ``shares`` says whether ``Oi`` is still a view of ``O`` before
    and after the first K/V tile."""
    N, d = Q.shape
    scale = 1.0 / math.sqrt(d)
    O = np.zeros_like(Q)
    L = np.zeros((N, 1))
    m = np.full((N, 1), -np.inf)
    shares = []
    for q_start in range(0, N, Br):
        Qi = Q[q_start:q_start + Br]
        Oi, mi, li = O[q_start:q_start + Br], m[q_start:q_start + Br], L[q_start:q_start + Br]
        shares.append(np.shares_memory(Oi, O))
        for k_start in range(0, N, Bc):
            Sij = Qi @ K[k_start:k_start + Bc].T * scale
            mi_new = np.maximum(mi, Sij.max(axis=1, keepdims=True))
            Oi = Oi * np.exp(mi - mi_new)  # a new array: Oi no longer refers to O
            li = li * np.exp(mi - mi_new)
            Pij = np.exp(Sij - mi_new)
            li = li + Pij.sum(axis=1, keepdims=True)
            Oi = Oi + Pij @ V[k_start:k_start + Bc]
            mi = mi_new
            shares.append(np.shares_memory(Oi, O))
    return O, shares


def demo_q31_views():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((8, 4)) for _ in range(3))
    want = ref.attention(q[None, None], k[None, None], v[None, None])[0][0, 0]
    o, shares = notes_q31_trusting_the_comment(q, k, v, 4, 4)
    print("question 3.1: `Oi = O[q_start:q_end]  # a reference, modified directly` (translated)")
    print(f"  Oi is a view of O before the K/V loop: {shares[0]}; after the first K/V tile "
          f"(`Oi = Oi * exp(mi - mi_new)`): {shares[1]}")
    o_fixed = notes_flash_attention_forward(q, k, v, 4, 4)
    print(f"  with the write-back `O[q_start:q_end] = Oi / li`: max |O - attention| "
          f"{err(np.abs(o_fixed - want).max())}")
    print(f"  without it, as the comment suggests: O all zero {bool((o == 0).all())}, "
          f"max |O - attention| {err(np.abs(o - want).max())}")


# [docs:notes-batch]
def notes_flash_attention_batch(Q, K, V, Br, Bc):
    """The notes' question-9.2 ``flash_attention_batch`` (``view`` is NumPy's ``reshape``)."""
    B, H, N, d = Q.shape
    Q = Q.reshape(BH, N, d)  # noqa: F821  (BH is never defined)
    K = K.reshape(BH, N, d)  # noqa: F821
    V = V.reshape(BH, N, d)  # noqa: F821
    O = np.empty_like(Q)
    L = np.empty((BH, N, 1))  # noqa: F821
    for b in range(B * H):
        O[b], L[b] = notes_flash_attention_forward(Q[b], K[b], V[b], Br, Bc)
    return O.reshape(B, H, N, d)


def notes_flash_attention_batch_bh(Q, K, V, Br, Bc):
    """The same with ``BH = B * H`` defined: the unpacking is still wrong."""
    B, H, N, d = Q.shape
    BH = B * H
    Q, K, V = (x.reshape(BH, N, d) for x in (Q, K, V))
    O = np.empty_like(Q)
    L = np.empty((BH, N, 1))
    for b in range(B * H):
        O[b], L[b] = notes_flash_attention_forward(Q[b], K[b], V[b], Br, Bc)
    return O.reshape(B, H, N, d)
# [/docs:notes-batch]


# [docs:fixed-batch]
def flash_attention_batch(Q, K, V, Br, Bc):
    """Fixed: ``BH`` defined, one value per call.  (For the statistics too, call a forward that
    returns them, such as question 6's, into ``L = np.empty((BH, N, 1))``.)"""
    B, H, N, d = Q.shape
    BH = B * H
    Q, K, V = (x.reshape(BH, N, d) for x in (Q, K, V))
    O = np.empty_like(Q)
    for b in range(BH):
        O[b] = notes_flash_attention_forward(Q[b], K[b], V[b], Br, Bc)
    return O.reshape(B, H, N, d)
# [/docs:fixed-batch]


def demo_batch():
    rng = np.random.default_rng(0)
    B, H, N, d = 2, 3, 8, 4
    q, k, v = (rng.standard_normal((B, H, N, d)) for _ in range(3))
    want = ref.attention(q, k, v)[0]
    print(f"the notes' batched wrapper (question 9), B={B}, H={H}, N={N}, d={d}, Br = Bc = 4:")
    for fn in (notes_flash_attention_batch, notes_flash_attention_batch_bh):
        try:
            fn(q, k, v, 4, 4)
        except (NameError, ValueError) as exc:
            print(f"  {fn.__name__:34s} {type(exc).__name__}: {exc}")
    got = flash_attention_batch(q, k, v, 4, 4)
    print(f"  {'flash_attention_batch (fixed)':34s} max |O - attention| "
          f"{err(np.abs(got - want).max())}")


# -- question 10: which loop is outer, counted ----------------------------------------------
class HBM:
    """Global memory that counts the elements read and written per array."""

    def __init__(self, **arrays):
        self.arrays = arrays
        self.reads = {name: 0 for name in arrays}
        self.writes = {name: 0 for name in arrays}

    def read(self, name, rows):
        self.reads[name] += self.arrays[name][rows].size
        return self.arrays[name][rows].copy()

    def write(self, name, rows, value):
        self.arrays[name][rows] = value
        self.writes[name] += np.asarray(self.arrays[name][rows]).size


# [docs:kv-outer-forward]
def kv_outer_forward(q, k, v, br, bc):
    """FlashAttention-1's Algorithm 1 (K/V blocks outer, Q blocks inner) for one head, with every
    HBM access counted.  Returns ``(o, hbm)``."""
    n, d = q.shape
    scale = 1.0 / math.sqrt(d)
    hbm = HBM(Q=q, K=k, V=v, O=np.zeros((n, d)), l=np.zeros(n), m=np.full(n, -np.inf))
    hbm.writes.update(O=n * d, l=n, m=n)  # step 2: initialise O, l, m in HBM
    for j in range(0, n, bc):
        kj, vj = hbm.read("K", slice(j, j + bc)), hbm.read("V", slice(j, j + bc))
        for i in range(0, n, br):
            rows = slice(i, i + br)
            qi, oi = hbm.read("Q", rows), hbm.read("O", rows)
            li, mi = hbm.read("l", rows), hbm.read("m", rows)
            s = scale * qi @ kj.T
            m_tile = s.max(axis=1)
            p = np.exp(s - m_tile[:, None])
            l_tile = p.sum(axis=1)
            m_new = np.maximum(mi, m_tile)
            l_new = np.exp(mi - m_new) * li + np.exp(m_tile - m_new) * l_tile
            oi = ((li * np.exp(mi - m_new))[:, None] * oi
                  + np.exp(m_tile - m_new)[:, None] * (p @ vj)) / l_new[:, None]
            hbm.write("O", rows, oi)
            hbm.write("l", rows, l_new)
            hbm.write("m", rows, m_new)
    return hbm.arrays["O"], hbm
# [/docs:kv-outer-forward]


# [docs:q-outer-forward]
def q_outer_forward(q, k, v, br, bc):
    """FlashAttention-2's forward order (Q blocks outer, K/V inner) for one head, counted the same
    way; ``O_i``, ``l_i``, ``m_i`` stay on chip and ``lse`` replaces ``l`` and ``m``."""
    n, d = q.shape
    scale = 1.0 / math.sqrt(d)
    hbm = HBM(Q=q, K=k, V=v, O=np.zeros((n, d)), lse=np.zeros(n))
    for i in range(0, n, br):
        rows = slice(i, i + br)
        qi = hbm.read("Q", rows)
        acc = np.zeros_like(qi)
        li = np.zeros(len(qi))
        mi = np.full(len(qi), -np.inf)
        for j in range(0, n, bc):
            kj, vj = hbm.read("K", slice(j, j + bc)), hbm.read("V", slice(j, j + bc))
            s = scale * qi @ kj.T
            m_new = np.maximum(mi, s.max(axis=1))
            alpha = np.exp(mi - m_new)
            p = np.exp(s - m_new[:, None])
            li = alpha * li + p.sum(axis=1)
            acc = alpha[:, None] * acc + p @ vj
            mi = m_new
        hbm.write("O", rows, acc / li[:, None])  # one division, one write
        hbm.write("lse", rows, mi + np.log(li))
    return hbm.arrays["O"], hbm
# [/docs:q-outer-forward]


# [docs:notes-v2]
def notes_flash_attention_v2_forward(Q, K, V, Br, Bc):
    """The notes' question-10.2 "v2" pseudo-code as written (NumPy for torch)."""
    N, d = Q.shape
    scale = 1.0 / math.sqrt(d)  # noqa: F841
    O = np.zeros((N, d))
    L = np.zeros((N, 1))
    m = np.full((N, 1), -float('inf'))  # noqa: F841
    Tc = (N + Bc - 1) // Bc
    Tr = (N + Br - 1) // Br
    for j in range(Tc):
        k_start = j * Bc
        k_end = min(N, k_start + Bc)
        Kj = K[k_start:k_end]  # noqa: F841
        Vj = V[k_start:k_end]  # noqa: F841
        for i in range(Tr):
            q_start = i * Br
            q_end = min(N, q_start + Br)
            Qi = Q[q_start:q_end]  # noqa: F841
        # (six comment lines: O_i, m_i, l_i "need to be loaded and written back" ...)
    return O / L
# [/docs:notes-v2]


def demo_loop_order(n=256, d=64, br=64, bc=64):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, d)) for _ in range(3))
    want = ref.attention(q[None, None], k[None, None], v[None, None])[0][0, 0]
    o1, h1 = kv_outer_forward(q, k, v, br, bc)
    o2, h2 = q_outer_forward(q, k, v, br, bc)
    print(f"one head, N = {n}, d = {d}, Br = {br}, Bc = {bc} (Tr = Tc = {n // br}); "
          "elements moved:")
    print("  array   K/V outer (FA1)       Q outer (FA2 forward)")
    print("          reads   writes       reads   writes")
    for name in ("Q", "K", "V", "O", "l", "m", "lse"):
        cells = []
        for h in (h1, h2):
            r, w = h.reads.get(name), h.writes.get(name)
            cells.append("      -        -" if r is None else f"{r:7d}  {w:7d}")
        print(f"  {name:5s} {cells[0]}      {cells[1]}")
    t1 = sum(h1.reads.values()) + sum(h1.writes.values())
    t2 = sum(h2.reads.values()) + sum(h2.writes.values())
    print(f"  total {t1:16d}      {t2:16d}")
    print(f"  O, l, m round trips per row: {h1.writes['O'] // (n * d)} writes of O (1 to"
          f" initialise + {n // bc} updates) vs {h2.writes['O'] // (n * d)}")
    print(f"  max |O - attention|: K/V outer {err(np.abs(o1 - want).max())}, "
          f"Q outer {err(np.abs(o2 - want).max())}")
    with np.errstate(invalid="ignore"):
        notes = notes_flash_attention_v2_forward(q, k, v, br, bc)
    print(f"  the notes' v2 pseudo-code returns O / L with O = L = 0: all NaN "
          f"{bool(np.isnan(notes).all())}")


def partial_states(s, v, splits, dtype=np.float64):
    """Split one query's scores ``s [N]`` and values ``v [N, d]`` at ``splits``; return the notes'
    block dicts ``{m, l, o}`` (``o`` unnormalised, ``l`` relative to the block's ``m``)."""
    blocks = []
    for s_b, v_b in zip(np.split(s, splits), np.split(v, splits)):
        s_b = s_b.astype(dtype)
        m = s_b.max()
        p = np.exp(s_b - m)
        blocks.append({"m": m, "l": p.sum(), "o": p @ v_b.astype(dtype)})
    return blocks


def to_lse_form(blocks):
    """The same states as ``reference.merge_states`` takes them: normalised ``o_p``, ``lse_p``."""
    o = np.stack([b["o"] / b["l"] for b in blocks]).astype(np.float64)
    lse = np.array([b["m"] + np.log(b["l"]) for b in blocks], dtype=np.float64)
    return o, lse


def fmt(values):
    return "[" + ", ".join(f"{float(v):.4f}" for v in values) + "]"


def demo_online_softmax():
    for x in ([1.0, 2.0], [1.0, 2.0, 3.0], [3.0, 2.0, 1.0]):
        print(f"x = {x}")
        print(f"  reference.softmax(x)          = {fmt(ref.softmax(x))}")
        print(f"  notes_online_softmax(x)       = {fmt(notes_online_softmax(x))}"
              f"   sum = {sum(notes_online_softmax(x)):.4f}")
        print(f"  notes, l fixed, out stale     = {fmt(notes_online_softmax_fixed_l(x))}"
              f"   sum = {sum(notes_online_softmax_fixed_l(x)):.4f}")
        print(f"  reference.online_softmax(x)   = {fmt(ref.online_softmax(x))}")
    x = [1.0, 2.0]
    m, l = ref.online_softmax_stats(x)
    # the notes' l after the loop, recomputed by hand: exp(1-2) added instead of multiplied
    l_notes = (0.0 + math.exp(0.0)) + math.exp(1.0 - 2.0) + math.exp(0.0)
    print(f"x = {x}: true (m, l) = ({m:.4f}, {l:.4f}); the notes' loop ends with l = {l_notes:.4f}")


def demo_merge():
    rng = np.random.default_rng(0)
    s = rng.standard_normal(8)
    v = rng.standard_normal((8, 2))
    p = np.exp(s - s.max())
    print("one query, 8 scores split into blocks [0:3], [3:6], [6:8]")
    print(f"  exact softmax(s) @ v                       {fmt((p / p.sum()) @ v)}")
    blocks = partial_states(s, v, [3, 6])
    try:
        notes_wrong_merge(blocks)
    except Exception as exc:  # noqa: BLE001  (showing the error is the point)
        print(f"  notes_wrong_merge(blocks)   -> {type(exc).__name__}: {exc}")
    print(f"    (blocks[1] is a dict: iterating it gives its keys {list(blocks[1])})")
    blocks = partial_states(s, v, [3, 6])
    o_first = blocks[0]["o"].copy()
    print(f"  notes_wrong_merge_sliced(blocks)           {fmt(notes_wrong_merge_sliced(blocks))}")
    print(f"    (and it wrote into its input: blocks[0]['o'] went from {fmt(o_first)}"
          f" to {fmt(blocks[0]['o'])})")
    print(f"  notes_correct_merge(fresh blocks)          "
          f"{fmt(notes_correct_merge(partial_states(s, v, [3, 6])))}")
    print(f"  reference.merge_states (lse form)          "
          f"{fmt(reference_merge(partial_states(s, v, [3, 6]))[0])}")
    for dtype, gap in ((np.float64, 800.0), (np.float32, 100.0)):
        shifted = s.copy()
        shifted[3:] += gap  # the later blocks' maxima exceed the first block's by ~gap
        p = np.exp(shifted - shifted.max())
        print(f"{np.dtype(dtype).name} states, later maxima ~{gap:.0f} above the first block's:")
        print(f"  exact                                      {fmt((p / p.sum()) @ v)}")
        with np.errstate(over="ignore", invalid="ignore"):
            got = notes_wrong_merge_sliced(partial_states(shifted, v, [3, 6], dtype))
        print(f"  notes_wrong_merge_sliced                   {fmt(got)}")
        print(f"  notes_correct_merge                        "
              f"{fmt(notes_correct_merge(partial_states(shifted, v, [3, 6], dtype)))}")
        print(f"  reference.merge_states                     "
              f"{fmt(reference_merge(partial_states(shifted, v, [3, 6], dtype))[0])}")


# -- question 8: tl.dot's dtype and size rules ------------------------------------------------
def demo_triton_dot():
    rng = np.random.default_rng(0)
    print("the notes' Triton kernel (keep_dims and [BLOCK_Q] statistics fixed) with tl.dot's two")
    print("rules enforced (StrictDotStandIn), one head, N = 32, float16 q, k, v:")
    for dd, block, min_dot in ((4, 4, "triton<=3.2"), (4, 4, "triton>=3.3"),
                               (16, 16, "triton<=3.2"), (16, 16, "triton>=3.3")):
        q, k, v = (rng.standard_normal((32, dd)).astype(np.float16) for _ in range(3))
        want = ref.attention(q[None, None], k[None, None], v[None, None])[0][0, 0]
        for label, p_cast in (("tl.dot(P, V)", False), ("tl.dot(P.to(V.dtype), V)", True)):
            try:
                o, _, _ = run_notes_triton(
                    q, k, v, block, lambda pid: StrictDotStandIn(pid, min_dot),
                    keep="keep_dims", stats_1d=True, p_cast=p_cast)
            except AssertionError as exc:
                print(f"  D = BLOCK = {dd:2d}, {min_dot:11s} {label:24s} AssertionError: {exc}")
                continue
            print(f"  D = BLOCK = {dd:2d}, {min_dot:11s} {label:24s} max |O - attention| "
                  f"{err(np.abs(o - want).max())}")


# -- questions 3, 5, 6: the statistics in the input dtype --------------------------------------
# [docs:notes-q-block]
def notes_flash_forward_q_block(Qi, K, V, Bc, scale, acc_dtype=None):
    """The notes' question-5 ``flash_forward_q_block`` (non-causal path) in NumPy: ``Oi``, ``li``
    and ``mi`` are created with ``dtype=Qi.dtype`` as in the notes (questions 3 and 6 do the
    same); ``acc_dtype=np.float32`` is the fix.  torch's float16 matmul and sum accumulate in
    float32 and round the result to float16 once: modelled by ``_mm`` and ``_rowsum``."""
    Br, d = Qi.shape
    N = K.shape[0]
    dt = Qi.dtype if acc_dtype is None else np.dtype(acc_dtype)
    Oi = np.zeros((Br, d), dt)
    li = np.zeros((Br, 1), dt)
    mi = np.full((Br, 1), -np.inf, dt)
    Tc = (N + Bc - 1) // Bc
    for j in range(Tc):
        k_start = j * Bc
        k_end = min(N, k_start + Bc)
        Kj, Vj = K[k_start:k_end], V[k_start:k_end]
        Sij = (_mm(Qi, Kj.T) * scale).astype(dt)
        row_max = Sij.max(axis=1, keepdims=True)
        mi_new = np.maximum(mi, row_max)
        Oi = Oi * np.exp(mi - mi_new)
        li = li * np.exp(mi - mi_new)
        Pij = np.exp(Sij - mi_new)
        li = li + _rowsum(Pij)
        Oi = Oi + _mm(Pij, Vj).astype(dt)
        mi = mi_new
    Oi = Oi / li
    return Oi, li
# [/docs:notes-q-block]


def _mm(a, b):
    """A matmul as torch does it on float16: float32 accumulation, one rounding to the type."""
    out = np.result_type(a.dtype, b.dtype)
    return (a.astype(np.float32) @ b.astype(np.float32)).astype(out)


def _rowsum(p):
    return p.astype(np.float32).sum(axis=1, keepdims=True).astype(p.dtype)


def demo_stats_dtype():
    rng = np.random.default_rng(0)
    print("the notes' flash_forward_q_block (question 5), float16 q, k, v, Br = 4, Bc = 64:")
    cases = (("N = 70000 keys, |s| < 0.1", 70000, 0.02, 0.0),
             ("N = 1024 keys, |s| < 0.1, v ~ 100 + N(0, 1)", 1024, 0.02, 100.0))
    for label, n, q_scale, v_shift in cases:
        q = (q_scale * rng.standard_normal((4, 8))).astype(np.float16)
        k = rng.standard_normal((n, 8)).astype(np.float16)
        v = (v_shift + rng.standard_normal((n, 8))).astype(np.float16)
        scale = 1 / math.sqrt(8)
        want = ref.attention(q[None, None], k[None, None], v[None, None])[0][0, 0]
        print(f"  {label}: reference max |O| {np.abs(want).max():.3g}")
        for name, acc in (("l, m, O in float16 (the notes)", None),
                          ("l, m, O in float32 (the fix)", np.float32)):
            with np.errstate(over="ignore", invalid="ignore"):
                o, li = notes_flash_forward_q_block(q, k, v, 64, scale, acc)
            o = o.astype(np.float64)
            bad = "all finite" if np.isfinite(o).all() else "not finite"
            rel = np.abs(o - want).max() / np.abs(want).max()
            # below 1e-3 as a power of ten: the last digits of float32 exp depend on the CPU
            shown = f"< 1e{math.floor(math.log10(rel)) + 1:d}" if rel < 1e-3 else f"{rel:.1e}"
            print(f"    {name:31s} l[0] = {float(li[0, 0]):<9.6g} O {bad}, "
                  f"max |O - ref| / max |ref| {shown}")


# -- question 6: asked for the log-sum-exp, returns l and m -------------------------------------
# [docs:notes-save-stats]
def notes_save_stats(Q, K, V, Br, Bc):
    """The notes' question-6 ``flash_attention_forward_save_stats`` (no mask) in NumPy, float64:
    returns ``(O, L, m)`` with ``L`` the final sum ``l`` (the notes' own name for it)."""
    N, d = Q.shape
    scale = 1.0 / math.sqrt(d)
    O = np.zeros_like(Q)
    L = np.zeros((N, 1))
    m = np.full((N, 1), -np.inf)
    for q_start in range(0, N, Br):
        i = slice(q_start, min(N, q_start + Br))
        Oi, mi, li = O[i], m[i], L[i]
        for k_start in range(0, N, Bc):
            j = slice(k_start, min(N, k_start + Bc))
            Sij = Q[i] @ K[j].T * scale
            mi_new = np.maximum(mi, Sij.max(axis=1, keepdims=True))
            Oi = Oi * np.exp(mi - mi_new)
            li = li * np.exp(mi - mi_new)
            Pij = np.exp(Sij - mi_new)
            li = li + Pij.sum(axis=1, keepdims=True)
            Oi = Oi + Pij @ V[j]
            mi = mi_new
        O[i], L[i], m[i] = Oi / li, li, mi
    return O, L, m
# [/docs:notes-save-stats]


# [docs:notes-save-stats-printed]
def notes_save_stats_as_printed(Q, K, V, Br, Bc):
    """Question 6 as the notes print it: ``for j in range(Tc):`` starts at the indentation of
    ``for i in range(Tr):``, so it runs once, after the Q loop, on the last Q tile's slices."""
    N, d = Q.shape
    scale = 1.0 / math.sqrt(d)
    O = np.zeros_like(Q)
    L = np.zeros((N, 1))
    m = np.full((N, 1), -np.inf)
    Tr = (N + Br - 1) // Br
    Tc = (N + Bc - 1) // Bc
    for i in range(Tr):
        q_start = i * Br
        q_end = min(N, q_start + Br)
        Qi = Q[q_start:q_end]
        Oi, mi, li = O[q_start:q_end], m[q_start:q_end], L[q_start:q_end]
    for j in range(Tc):  # not nested: Qi, Oi, mi, li are the last Q tile's
        k_start = j * Bc
        k_end = min(N, k_start + Bc)
        Sij = Qi @ K[k_start:k_end].T * scale
        mi_new = np.maximum(mi, Sij.max(axis=1, keepdims=True))
        Oi = Oi * np.exp(mi - mi_new)
        li = li * np.exp(mi - mi_new)
        Pij = np.exp(Sij - mi_new)
        li = li + Pij.sum(axis=1, keepdims=True)
        Oi = Oi + Pij @ V[k_start:k_end]
        mi = mi_new
    O[q_start:q_end], L[q_start:q_end], m[q_start:q_end] = Oi / li, li, mi
    return O, L, m
# [/docs:notes-save-stats-printed]


def demo_q6_nesting():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((12, 4)) for _ in range(3))
    want = ref.attention(q[None, None], k[None, None], v[None, None])[0][0, 0]
    o, L, m = notes_save_stats_as_printed(q, k, v, 4, 4)
    print("question 6 as printed (the K/V loop not nested in the Q loop), N = 12, Br = Bc = 4:")
    for rows in (slice(0, 4), slice(4, 8), slice(8, 12)):
        zero_o, zero_l = bool((o[rows] == 0).all()), bool((L[rows] == 0).all())
        print(f"  rows {rows.start:2d}..{rows.stop - 1:2d}: O all zero {zero_o!s:5s}"
              f"  L all zero {zero_l!s:5s}  max |O - attention| "
              f"{err(np.abs(o[rows] - want[rows]).max())}")
    o2, _, _ = notes_save_stats(q, k, v, 4, 4)
    print(f"  nested (the transcription above): max |O - attention| "
          f"{err(np.abs(o2 - want).max())}")


# -- question 7.2: the comment over the dV line names dP ---------------------------------------
def demo_q72_comment():
    rng = np.random.default_rng(0)
    print("question 7.2, over `dV_j += Pij.T @ dO_i`: \"# compute the dV contribution: "
          "dP = dO_i @ V_j.T,")
    print("then accumulate into dV_j\" (translated)")
    for br, bc, d in ((4, 3, 5), (4, 4, 4)):
        q, do = (rng.standard_normal((br, d)) for _ in range(2))
        k, v = (rng.standard_normal((bc, d)) for _ in range(2))
        want = ref.attention_backward(do[None, None], q[None, None], k[None, None],
                                      v[None, None])[2][0, 0]
        lse = ref.attention(q[None, None], k[None, None], v[None, None])[1][0, 0]
        p = np.exp(q @ k.T / math.sqrt(d) - lse[:, None])
        print(f"  Br = {br}, Bc = {bc}, d = {d}: dO_i @ V_j.T has shape "
              f"{(do @ v.T).shape} (that is dP_ij), Pij.T @ dO_i {(p.T @ do).shape} "
              f"(dV_j's shape)")
        dv = np.zeros((bc, d))
        try:
            dv += do @ v.T  # the comment's formula in the dV line
        except ValueError as exc:
            print(f"    dV_j += dO_i @ V_j.T: ValueError: {str(exc).strip()}")
            continue
        print(f"    dV_j += dO_i @ V_j.T runs (all sizes equal) and is wrong: "
              f"max |dV - reference| {err(np.abs(dv - want).max())}; "
              f"Pij.T @ dO_i: {err(np.abs(p.T @ do - want).max())}")


def demo_lse():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((8, 4)) for _ in range(3))
    o, L, m = notes_save_stats(q, k, v, 4, 4)
    o_ref, lse = ref.attention(q[None, None], k[None, None], v[None, None])
    lse = lse[0, 0]
    print("the notes' flash_attention_forward_save_stats (question 6), N = 8, d = 4, Br = Bc = 4:")
    print(f"  returns O, L, m: max |O - attention| {err(np.abs(o - o_ref[0, 0]).max())}")
    print(f"  L[:3, 0]            {fmt(L[:3, 0])}   (the sum l, not the log-sum-exp)")
    print(f"  m[:3, 0] + log L    {fmt((m + np.log(L))[:3, 0])}")
    print(f"  reference lse[:3]   {fmt(lse[:3])}")
    print(f"  max |m + log L - lse| {err(np.abs((m + np.log(L))[:, 0] - lse).max())}")


# -- question 13: partial sums against different maxima ---------------------------------------
# [docs:notes-13-cases]
def stale_max_merge(blocks, m_ref):
    """The notes' 13.1 scenario: every block's terms taken against one stale max ``m_ref``
    (exp(s - 10) for block 2, whose max is 20).  One common max: right, if nothing overflows."""
    l = sum(b["l"] * np.exp(b["m"] - m_ref) for b in blocks)
    o = sum(b["o"] * np.exp(b["m"] - m_ref) for b in blocks)
    return o / l


def unrescaled_merge(blocks):
    """The failure 13.1 never runs: the max is updated but what was summed before is not
    rescaled, so ``l`` adds terms taken against different maxima."""
    m, l, o = -np.inf, 0.0, 0.0
    for b in blocks:
        m_new = max(m, b["m"])
        l = l + b["l"] * np.exp(b["m"] - m_new)  # the old l is still against the old m
        o = o + b["o"] * np.exp(b["m"] - m_new)
        m = m_new
    return o / l
# [/docs:notes-13-cases]


def demo_merge_maxima():
    rng = np.random.default_rng(1)
    s = rng.standard_normal(8)
    v = rng.standard_normal((8, 2))
    print("one query, two blocks of scores [0:4], [4:8]; block 2 shifted so its max is `gap`")
    print("above block 1's (the notes' 13.1 example: maxima 10 and 20, gap 10):")
    print("max |o - exact| of three merges of float64 states:")
    print(f"  {'gap':>6s} {'stale_max_merge':>16s} {'unrescaled_merge':>17s} "
          f"{'notes_correct_merge':>20s}")
    for gap in (0.1, 1.0, 10.0, 1000.0):
        x = s.copy()
        x[:4] += 10 - x[:4].max()
        x[4:] += 10 + gap - x[4:].max()
        p = np.exp(x - x.max())
        exact = (p / p.sum()) @ v
        e = []
        for merge in (lambda b: stale_max_merge(b, 10.0), unrescaled_merge, notes_correct_merge):
            with np.errstate(over="ignore", invalid="ignore"):
                got = merge(partial_states(x, v, [4]))
            e.append(float(np.abs(got - exact).max()))
        print(f"  {gap:6.1f} " + " ".join(f"{err(x, w)}" for x, w in zip(e, (16, 17, 20))))


# -- question 2: "in decode N is small" -------------------------------------------------------
def demo_decode_io():
    from io_count import standard_attention_bytes, tiled_forward_bytes
    d, item = 64, 2
    print(f"one head, d = {d}, float16, Q tiles of 128 rows, K/V tiles of 64; bytes moved by the")
    print("models tests/docs/test_io_count.py checks against the kernels:")
    print(f"  {'shape':24s} {'standard':>14s} {'flash':>14s} {'standard / flash':>17s}")
    for nq, nk in ((4096, 4096), (1, 4096), (1, 131072)):
        std = standard_attention_bytes(nq, nk, d, item)
        fl = tiled_forward_bytes(1, 1, nq, nk, d, 128, 64, item, 4)
        std_b, fl_b = std["read"] + std["written"], fl["read"] + fl["written"]
        label = f"Nq = {nq}, N = {nk}"
        print(f"  {label:24s} {std_b:14,d} {fl_b:14,d} {std_b / fl_b:17.2f}")


# -- question 9.1: K/V offsets from Q's strides -----------------------------------------------
def head_from_offset(flat, base, stride_n, n, d):
    """Rows ``0..n-1`` of one head read through a flat pointer: ``flat[base + r * stride_n + c]``
    (what ``tl.load`` does), IndexError past the end (a fault, or another tensor, on a GPU)."""
    idx = base + np.arange(n)[:, None] * stride_n + np.arange(d)[None, :]
    if idx.max() >= flat.size:
        raise IndexError("load past the end of the buffer")
    return flat[idx]


def demo_strides():
    rng = np.random.default_rng(0)
    print("the notes' 9.1 offset `offs_b = b * stride_q_b + h * stride_q_h` used for Q, K and V;")
    print("head (b, h) = (1, 1), d = 4, attention of that head against the reference:")
    cases = (("same shapes, contiguous", (2, 2, 6), (2, 2, 6), False),
             ("Nk = 9 != Nq = 6", (2, 2, 6), (2, 2, 9), False),
             ("GQA: H = 4, Hkv = 2", (2, 4, 6), (2, 2, 6), False),
             ("K, V as [B, N, H, d] views", (2, 2, 6), (2, 2, 6), True))
    b, h, d = 1, 1, 4
    for label, (bq, hq, nq), (bk, hk, nk), bshd in cases:
        q = rng.standard_normal((bq, hq, nq, d))
        k, v = (rng.standard_normal((bk, hk, nk, d)) for _ in range(2))
        if bshd:  # a [B, N, H, d] buffer seen as [B, H, N, d]: strides of another layout
            k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                    for x in (k, v))
        want = ref.attention(q, k, v)[0][b, h]
        sq = [s // 8 for s in q.strides]
        sk = [s // 8 for s in k.strides]
        h_kv = h // (hq // hk)
        flat_k = np.lib.stride_tricks.as_strided(k, (k.size,), (8,)) if not bshd else \
            np.ascontiguousarray(k.transpose(0, 2, 1, 3)).ravel()
        flat_v = np.lib.stride_tricks.as_strided(v, (v.size,), (8,)) if not bshd else \
            np.ascontiguousarray(v.transpose(0, 2, 1, 3)).ravel()
        results = []
        for name, off, stride_n in (("notes", b * sq[0] + h * sq[1], sq[2]),
                                    ("fixed", b * sk[0] + h_kv * sk[1], sk[2])):
            try:
                kh = head_from_offset(flat_k, off, stride_n, nk, d)
                vh = head_from_offset(flat_v, off, stride_n, nk, d)
            except IndexError as exc:
                results.append(f"{name}: IndexError ({exc})")
                continue
            o = ref.attention(q[b, h][None, None], kh[None, None], vh[None, None])[0][0, 0]
            results.append(f"{name}: max |O - ref| {err(np.abs(o - want).max())}")
        print(f"  {label:27s} " + ";  ".join(results))


def reference_merge(blocks):
    o_parts, lse_parts = to_lse_form(blocks)
    return ref.merge_states(o_parts, lse_parts)


if __name__ == "__main__":
    {"online-softmax": demo_online_softmax, "merge": demo_merge, "paged": demo_paged,
     "triton": demo_triton, "batch": demo_batch, "loop-order": demo_loop_order,
     "triton-dot": demo_triton_dot, "stats-dtype": demo_stats_dtype, "lse": demo_lse,
     "merge-maxima": demo_merge_maxima, "decode-io": demo_decode_io,
     "strides": demo_strides, "paged-init": demo_paged_init, "q31-views": demo_q31_views,
     "q6-nesting": demo_q6_nesting, "q72-comment": demo_q72_comment}[sys.argv[1]]()
