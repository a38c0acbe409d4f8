"""The source notes' code, transcribed to Python as written (bugs included), and the demos that
show each bug on a concrete input.  ``tests/docs/test_notes_code.py`` checks every claim made
here; ``docs/online-softmax.md`` and ``docs/merge-states.md`` quote the output of::

    python docs/examples/notes_code.py online-softmax
    python docs/examples/notes_code.py merge
    python docs/examples/notes_code.py paged
"""

from __future__ import annotations

import math
import sys

import numpy as np

from numba_flash import reference as ref


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
    """``ceil(seq_len / block_size)`` as C evaluates it on two ints: the division truncates first."""
    return math.ceil(a // b)


def notes_paged_attention(Q, block_table, kv_cache, seq_len, block_size, head, scale,
                          count_blocks=c_ceil_of_int_division, store_max=False):
    """The notes' ``flash_paged_attention_kernel`` for one Q block (rows ``0 .. Br-1``), one
    head, transcribed statement by statement; ``kv_cache`` is ``[2, num_blocks, heads,
    block_size, d]`` as in the notes.  Returns ``O[q_start:q_end]``.  The two keyword arguments
    switch on the fixes: ``count_blocks=ceil_div``, ``store_max=True``."""
    Br, head_dim = Q.shape
    q_start, q_end = 0, min(Br, seq_len)
    Q_s = Q[q_start:q_end]
    O_s = np.zeros((Br, head_dim))
    l_s = np.zeros(Br)
    m_s = np.full(Br, -np.inf)
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
        S = (Q_s @ K_s.T) * scale  # [q_end - q_start, valid_tokens]
        for r in range(q_end - q_start):
            row_max = S[r].max()
            m_new = max(m_s[r], row_max)
            factor = math.exp(m_s[r] - m_new)
            l_s[r] = l_s[r] * factor + np.exp(S[r] - m_new).sum()
            O_s[r] = O_s[r] * factor + np.exp(S[r] - m_new) @ V_s
            if store_max:
                m_s[r] = m_new  # missing in the notes: m_s[r] stays -inf, so factor is always 0
    return O_s[: q_end - q_start] / l_s[: q_end - q_start, None]
# [/docs:notes-paged]


def ceil_div(a, b):
    return -(-a // b)


def paged_example(rng, seq_len, scale, block_size=4, d=4, n_blocks=8, heads=2, head=1):
    """A random one-sequence paged cache (the notes' layout) with a scrambled block table, and
    the float64 attention of ``Q`` over the sequence's ``seq_len`` keys: ``(Q, table, kv, want)``."""
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
        for count, store, label in ((c_ceil_of_int_division, False, "as written"),
                                    (c_ceil_of_int_division, True, "+ m_s[r] = m_new"),
                                    (ceil_div, True, "+ ceil_div(seq_len, block_size)")):
            got = notes_paged_attention(Q, table, kv, seq_len, 4, 1, scale, count, store)
            print(f"  seq_len={seq_len:2d} ({count(seq_len, 4)} blocks read) {label:32s}"
                  f" {np.abs(got - want).max():.2e}")
    Q, table, kv, want = paged_example(rng, 12, scale)
    bad = table.copy()
    bad[1] = -1
    got = notes_paged_attention(Q, bad, kv, 12, 4, 1, scale, ceil_div, True)
    print(f"  seq_len=12, block_table = {bad.tolist()}, both fixes: no error, all finite "
          f"{bool(np.isfinite(got).all())},")
    print(f"  max |O - attention| {np.abs(got - want).max():.2e} (keys 4..7 silently dropped)")


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


def reference_merge(blocks):
    o_parts, lse_parts = to_lse_form(blocks)
    return ref.merge_states(o_parts, lse_parts)


if __name__ == "__main__":
    {"online-softmax": demo_online_softmax, "merge": demo_merge, "paged": demo_paged}[sys.argv[1]]()
