"""The numbers and pictures of docs/own-variant.md: a user's ``score_mod`` / ``mask_mod`` / block
mask in the tensor-core forward (float16, the simulator), each against
:func:`numba_flash.reference.attention` called with the same functions.

``docs/own-variant.md`` quotes the output of::

    python docs/examples/flex_demo.py scores      # relative bias; softcap + ALiBi re-expressed
    python docs/examples/flex_demo.py documents   # packed documents vs forward_varlen
    python docs/examples/flex_demo.py prefix      # prefix-LM (and every aux to every function)
    python docs/examples/flex_demo.py tiles       # the block mask: tiles visited, and their cost

Errors print with their digits (the simulator's float32 arithmetic is IEEE, the same on every
machine) or, at float64 rounding, as ``< 1e-14`` (:mod:`report`).
``tests/docs/test_flex_demo.py`` checks every claim printed here.
"""

from __future__ import annotations

import math
import sys

import numpy as np
from report import err

import numba_flash
from numba_flash import reference as ref
from numba_flash.flex import EMPTY, create_block_mask

#: the demo's tensors: float16, d = 16 (the simulator's kernels: one warp, 16 keys a K/V tile)
D = 16


def qkv(seed, b=1, h=2, hkv=2, n=48):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(np.float16)
                 for s in ((b, h, n, D), (b, hkv, n, D), (b, hkv, n, D)))


def max_err(got, want):
    """``(o error, lse error)``: max |got - want| over the finite entries of the float64 oracle."""
    o, lse = got
    o_r, lse_r = want
    fin = np.isfinite(lse_r)
    assert np.array_equal(np.isfinite(lse), fin), "rows that see no key differ"
    return (float(np.max(np.abs(o.astype(np.float64) - o_r))),
            float(np.max(np.abs(lse[fin] - lse_r[fin]), initial=0.0)))


# -- scores ------------------------------------------------------------------------------------
# [docs:flex-relative-bias]
def relative_bias(score, b, h, q_idx, kv_idx, bias):
    """T5-style: a learned bias per head and distance (``bias [H, 2N - 1]``, distance 0 in the
    middle)."""
    return score + bias[h, q_idx - kv_idx + (bias.shape[1] - 1) // 2]
# [/docs:flex-relative-bias]


# [docs:flex-softcap-alibi]
CAP = 30.0   # a global: read (and frozen) when Numba compiles the function


def softcap_alibi(score, b, h, q_idx, kv_idx, slopes):
    """The built-in ``softcap=CAP, alibi_slopes=slopes`` (Nq == Nk) as one score_mod."""
    capped = CAP * math.tanh(score / CAP)
    return capped - float(slopes[h]) * abs(q_idx - kv_idx)   # float(): see the page
# [/docs:flex-softcap-alibi]


def scores_rows():
    q, k, v = qkv(0, n=32)
    n, h = q.shape[2], q.shape[1]
    bias = np.random.default_rng(1).standard_normal((h, 2 * n - 1)).astype(np.float32)
    slopes = ref.alibi_slopes(h).astype(np.float32)
    rows = []
    # [docs:flex-call]
    kw = dict(score_mod=relative_bias, aux_tensors=(bias,), causal=True)
    want = ref.attention(q, k, v, **kw)                        # float64, the same function
    got = numba_flash.forward(q, k, v, return_lse=True, kernel="mma", **kw)  # tensor cores
    # [/docs:flex-call]
    rows.append(("relative_bias, causal", "kernel vs reference(score_mod)",
                 *max_err(got, want)))

    builtin = dict(softcap=CAP, alibi_slopes=slopes)
    mine = dict(score_mod=softcap_alibi, aux_tensors=(slopes,))
    ref_builtin = ref.attention(q, k, v, **builtin)
    ref_mine = ref.attention(q, k, v, **mine)
    rows.append(("softcap_alibi", "reference(score_mod) vs reference(built-in)",
                 *max_err(ref_mine, ref_builtin)))
    k_mine = numba_flash.forward(q, k, v, return_lse=True, kernel="mma", **mine)
    k_builtin = numba_flash.forward(q, k, v, return_lse=True, kernel="mma", **builtin)
    rows.append(("softcap_alibi", "kernel(score_mod) vs reference(score_mod)",
                 *max_err(k_mine, ref_mine)))
    rows.append(("softcap_alibi", "kernel(built-in) vs reference(built-in)",
                 *max_err(k_builtin, ref_builtin)))
    rows.append(("softcap_alibi", "kernel(score_mod) vs kernel(built-in)",
                 *max_err(k_mine, (k_builtin[0].astype(np.float64), k_builtin[1]))))
    return rows


def print_rows(title, rows):
    print(title)
    print(f"  {'variant':24s}{'compared':46s}{'o':>9s}{'lse':>10s}")
    for name, what, eo, el in rows:
        print(f"  {name:24s}{what:46s}{err(eo, 9)}{err(el, 10)}")


def scores():
    print_rows("float16, B = 1, H = 2, N = 32, d = 16 (max |error|)", scores_rows())


# -- documents ---------------------------------------------------------------------------------
# [docs:flex-documents]
def same_document(b, h, q_idx, kv_idx, doc):
    """Packed sequences: a token sees only the tokens of its own document (``doc [B, N]``)."""
    return doc[b, q_idx] == doc[b, kv_idx]
# [/docs:flex-documents]

#: the packed documents of the demo (lengths, in tokens)
DOC_LENS = (10, 22, 16)


def documents_rows():
    q, k, v = qkv(2, h=1, hkv=1)
    n = q.shape[2]
    # [docs:flex-block-mask-call]
    doc = np.repeat(np.arange(len(DOC_LENS), dtype=np.int32), DOC_LENS)[None]   # [1, N]
    bm = create_block_mask(same_document, 1, None, n, n, aux_tensors=(doc,), BLOCK_SIZE=16)
    kw = dict(mask_mod=same_document, aux_tensors=(doc,), causal=True)
    want = ref.attention(q, k, v, **kw)
    per_element = numba_flash.forward(q, k, v, return_lse=True, kernel="mma", **kw)
    blocked = numba_flash.forward(q, k, v, return_lse=True, kernel="mma", block_mask=bm, **kw)
    # [/docs:flex-block-mask-call]
    # the same documents as a varlen batch: [total, H, d] and their offsets
    cu = np.concatenate([[0], np.cumsum(DOC_LENS)]).astype(np.int32)
    qp, kp, vp = (x[0].transpose(1, 0, 2).copy() for x in (q, k, v))
    o_v, lse_v = numba_flash.forward_varlen(qp, kp, vp, cu, cu, max_seqlen_q=max(DOC_LENS),
                                            max_seqlen_k=max(DOC_LENS), causal=True,
                                            return_lse=True)
    varlen = (o_v.transpose(1, 0, 2)[None], lse_v[None])       # back to [1, H, N, d]
    o_vr, lse_vr = ref.attention_varlen(qp, kp, vp, cu, cu, causal=True)
    rows = [("mask_mod, no block mask", "kernel vs reference(mask_mod)",
             *max_err(per_element, want)),
            ("mask_mod + block mask", "kernel vs reference(mask_mod)", *max_err(blocked, want)),
            ("mask_mod + block mask", "kernel vs forward_varlen",
             *max_err(blocked, (varlen[0].astype(np.float64), varlen[1]))),
            ("forward_varlen", "reference_varlen vs reference(mask_mod)",
             *max_err((o_vr.transpose(1, 0, 2)[None], lse_vr[None]), want))]
    same = bool(np.array_equal(per_element[0], blocked[0]))
    return rows, bm, same


def documents():
    rows, bm, same = documents_rows()
    print(f"documents of {', '.join(map(str, DOC_LENS))} tokens packed in N = {sum(DOC_LENS)}, "
          f"causal, float16, H = 1, d = 16")
    print(bm)
    print_rows("max |error|", rows)
    print(f"with and without the block mask, o is bit for bit the same: {same}")


# -- prefix-LM ---------------------------------------------------------------------------------
# [docs:flex-prefix-lm]
def prefix_lm(b, h, q_idx, kv_idx, bias, prefix):
    """Every token sees its sequence's prefix (``prefix[b]`` tokens) both ways, the rest
    causally.  It takes ``bias`` too: every function receives every aux tensor."""
    return kv_idx < prefix[b] or kv_idx <= q_idx


def prefix_bias(score, b, h, q_idx, kv_idx, bias, prefix):
    return relative_bias(score, b, h, q_idx, kv_idx, bias)    # a helper call: compiled too
# [/docs:flex-prefix-lm]


def prefix_rows():
    q, k, v = qkv(3, b=2, h=2, hkv=1, n=24)
    bias = np.random.default_rng(4).standard_normal((2, 47)).astype(np.float32)
    prefix = np.array([5, 18], np.int32)
    kw = dict(mask_mod=prefix_lm, score_mod=prefix_bias, aux_tensors=(bias, prefix))
    return [("prefix_lm + prefix_bias", "kernel vs reference(same functions)",
             *max_err(numba_flash.forward(q, k, v, return_lse=True, kernel="mma", **kw),
                      ref.attention(q, k, v, **kw)))]


def prefix():
    print_rows("prefixes of 5 and 18 tokens, B = 2, H = 2, Hkv = 1 (GQA), N = 24, float16 "
               "(max |error|)", prefix_rows())


# -- tiles -------------------------------------------------------------------------------------
def documents_of(lengths):
    return np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)[None]


def kernel_tile():
    """``(query rows, keys)`` of the simulator's tensor-core forward tile (32 x 16: one warp's
    two 16-row tiles, 16 keys): the tiles demo's block size, so that each tile the kernel
    visits is one block of the mask."""
    from numba_flash.kernels.forward.config import forward_mma_config

    cfg = forward_mma_config(D, simulator=True)
    return cfg.BLOCK_M, cfg.BLOCK_N


def visited_tiles(lengths, seed=5):
    """Run the kernel on one head with a block mask of the documents ``lengths`` in blocks of the
    kernel's tile (:func:`kernel_tile`) and count the (Q tile, K/V tile) pairs it computes (the
    simulator's tile log), against the block mask's non-EMPTY blocks."""
    from numba_flash.kernels.core import common
    from numba_flash.kernels.forward import mma as forward_mma

    # the log's home: kernels/core/common.py (shared by the kernels), formerly
    # kernels/forward/mma.py
    home = common if hasattr(common, "TILE_LOG") else forward_mma
    n = sum(lengths)
    q, k, v = qkv(seed, h=1, hkv=1, n=n)
    doc = documents_of(lengths)
    bm = create_block_mask(same_document, 1, 1, n, n, aux_tensors=(doc,),
                           BLOCK_SIZE=kernel_tile())
    home.TILE_LOG = log = []
    try:
        o = numba_flash.forward(q, k, v, block_mask=bm, aux_tensors=(doc,), kernel="mma")
    finally:
        home.TILE_LOG = None
    o_err = float(np.max(np.abs(o - ref.attention(q, k, v, mask_mod=same_document,
                                                    aux_tensors=(doc,))[0])))
    return {"lengths": lengths, "n": n, "visited": len(log), "tiles": sorted(set(log)),
            "non_empty": int((bm.kind != EMPTY).sum()), "all": bm.kind.size,
            "sparsity": bm.sparsity(), "o_err": o_err, "bm": bm}


#: document layouts run in the kernel: the same 64 tokens cut into more, shorter documents
LAYOUTS = [(64,), (16, 16, 16, 16), (8,) * 8, (5, 19, 12, 28)]


def scaling_rows(doc_len=256, block=128, sizes=(1024, 2048, 4096, 8192)):
    """Host only (create_block_mask, no kernel run): documents of ``doc_len`` tokens,
    FlexAttention's default 128 x 128 blocks; non-EMPTY blocks against all blocks as N grows."""
    rows = []
    for n in sizes:
        doc = documents_of([doc_len] * (n // doc_len))
        bm = create_block_mask(same_document, 1, 1, n, n, aux_tensors=(doc,), BLOCK_SIZE=block)
        rows.append({"n": n, "non_empty": int((bm.kind != EMPTY).sum()), "all": bm.kind.size,
                     "sparsity": bm.sparsity()})
    return rows


def tiles():
    qb, kb = kernel_tile()
    print(f"64 tokens, one head, blocks of the kernel's {qb} x {kb} tiles "
          f"({64 // qb} x {64 // kb} = {(64 // qb) * (64 // kb)} per head); the kernel's tile log")
    print(f"  {'documents':22s}{'visited':>8s}{'non-EMPTY':>10s}{'sparsity':>9s}"
          f"{'o error':>10s}")
    runs = [visited_tiles(lengths) for lengths in LAYOUTS]
    for r in runs:
        print(f"  {', '.join(map(str, r['lengths'])):22s}{r['visited']:8d}{r['non_empty']:10d}"
              f"{r['sparsity']:9.0%}{err(r['o_err'], 10)}")
    r = runs[-1]
    print(f"documents {', '.join(map(str, r['lengths']))}:")
    print(r["bm"])
    print("tiles the kernel computed (q tile start, k tile):",
          ", ".join(f"({qs}, {kt})" for _, _, qs, kt in r["tiles"]))
    print()
    print("documents of 256 tokens, 128 x 128 blocks (FlexAttention's default), block mask only")
    print(f"  {'N':>6s}{'non-EMPTY':>11s}{'all blocks':>12s}{'sparsity':>10s}")
    for r in scaling_rows():
        print(f"  {r['n']:6d}{r['non_empty']:11d}{r['all']:12d}{r['sparsity']:10.1%}")


COMMANDS = {"scores": scores, "documents": documents, "prefix": prefix, "tiles": tiles}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in COMMANDS:
        raise SystemExit(f"usage: flex_demo.py {{{'|'.join(COMMANDS)}}}")
    COMMANDS[argv[0]]()


if __name__ == "__main__":
    main()
