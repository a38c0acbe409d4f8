"""Decode's compile-tier configurations: split-KV, MLA's absorbed decode and the merge."""

from __future__ import annotations

import dataclasses

import numpy as np

from numba import types
from numba_flash.kernels.core.common import acc_dtype, numba_array_type
from numba_flash.kernels.core.config import MMA_DTYPES
from numba_flash.kernels.core.elements import BFLOAT16
from numba_flash.kernels.decode import config as dconfig
from numba_flash.kernels.decode.config import mla_decode_config
from numba_flash.kernels.decode import merge
from numba_flash.kernels.decode import mla
from numba_flash.kernels.decode import split_kv
from numba_flash.kernels.ptx import fp8


def split_kv_configs():
    """The GPU configurations the compile tier builds (a compile costs ~10 s, so a selection):
    float16 and float32 at ``HEAD_DIM = 128`` with the most rows launched there, float16 at 64
    and at 256, the softcap + ALiBi variant, and float64 at 128, all with 16-byte loads
    (``VEC``), and float16 at 128 with element loads (a padded head dim).  Other combinations
    are the same source with other constants and compile on first use.  A user's variant
    (:func:`_user_config`): float16 at 128 with a score_mod and a mask_mod reading aux arrays.
    A tokens-first cache (``SLOT_STRIDE``): float16 at 128, 16-bit and e4m3."""
    def cfg(dtype, HEAD_DIM, softcap=False, alibi=False, vec=True, paged=True, user=None,
            own_v=None, kv_fp8=False, rows=None, gather=False, tokens_first=False):
        dtype = np.dtype(dtype)
        fns, aux = (None, ()) if user is None else user
        rows = rows or dconfig.gpu_rows_max(np.uint8 if kv_fp8 else dtype, HEAD_DIM)
        config = dconfig.launch_shape(dtype, HEAD_DIM, rows, False, VEC=vec, PAGED=paged,
                                      SOFTCAP=softcap, ALIBI=alibi, USER=fns,
                                      OWN_V=own_v is not None, KV_FP8=kv_fp8, GATHER=gather,
                                      SLOT_STRIDE=tokens_first)
        tag = (" softcap" if softcap else "") + (" alibi" if alibi else "")
        tag += ("" if vec else " word loads" if kv_fp8 else " element loads")
        tag += "" if paged else " contiguous"
        tag += "" if user is None else " score_mod mask_mod"
        tag += "" if own_v is None else f" {own_v}"
        tag += " e4m3 cache" if kv_fp8 else ""
        tag += " kv_indices" if gather else ""
        tag += " tokens-first" if tokens_first else ""
        return {
            "name": f"decode {dtype.name} D={HEAD_DIM} ROWS={config.ROWS} U={config.U}{tag}",
            "config": config,
            "kernel": split_kv.decode_kernel(config),
            "args": split_kv.kernel_args_types(dtype, alibi, vec, aux, kv_fp8),
            "launch_bounds": dconfig.launch_bounds(dconfig.GPU_THREADS, dtype, HEAD_DIM),
            "float64_ok": dtype == np.float64,
            **({"cc": fp8.CC} if kv_fp8 else {}),   # e4m3 conversions: sm_89+
            # the SASS tier counts the loop that streams K/V: for float16/32 the innermost one
            # holding 25% of the kernel's FFMAs (by global loads it would be a combine loop;
            # a user's build at float16 d=128 has 29% in it since the sink's exps joined the
            # epilogue and the combine)
            "sass": {"work": "ldg" if dtype == np.float64 else "ffma", "share": 0.25,
                     "streaming": True},
        }

    for dtype in dconfig.DTYPES[:2]:
        yield cfg(dtype, 128)
    yield cfg(np.float16, 64)
    yield cfg(np.float16, 256)
    yield cfg(np.float16, 128, softcap=True, alibi=True)
    yield cfg(np.float64, 128)
    yield cfg(np.float16, 128, vec=False)
    yield cfg(np.float16, 128, paged=False)
    # bfloat16: the float16 kernel with other loads (float32 views split into words) and stores
    yield cfg(BFLOAT16, 128)
    yield cfg(BFLOAT16, 64, paged=False)
    yield cfg(np.float16, 128, user=_user_config())
    # an e4m3 cache (issue 46): 16 values per 16-byte load, widened in registers; a GQA group
    # of two rows (the most a block holds) and one row (MHA)
    yield cfg(np.float16, 128, kv_fp8=True)
    yield cfg(np.float16, 128, kv_fp8=True, rows=1)
    # token-sparse decode (issue 47): each key found through its list entry (and its page)
    yield cfg(np.float16, 128, gather=True)
    # a tokens-first cache (flash-attn's [.., N, Hkv, d] memory, issue 61): the slot stride a
    # launch parameter (key u of a step u strides further, not an immediate offset)
    yield cfg(np.float16, 128, tokens_first=True)
    yield cfg(np.float16, 128, kv_fp8=True, tokens_first=True)
    # MLA's absorbed decode: the 576-wide latent cache read twice (V: its first 512 columns)
    # in the 1024-wide build (element loads: 576 is not a whole lane layout yet)
    yield cfg(np.float16, 1024, vec=False, own_v="MLA 576/512")
    # the same over an e4m3 latent cache: 32-bit words of 4 values (576 = 144 words)
    yield cfg(np.float16, 1024, vec=False, own_v="MLA 576/512", kv_fp8=True)


def _user_config():
    """``((score_mod, mask_mod), aux types)`` of the compile tier's user build: the examples of
    :mod:`numba_flash.flex.examples` (a relative-position bias table and per-token document
    ids), each taking both aux arrays, as device functions (the builds above have none)."""
    from numba_flash.flex.examples import document_mask, relative_bias
    from numba_flash.flex.functions import device_function

    def biased(score, b, h, q_idx, kv_idx, bias, doc):   # every function gets every aux array
        return relative_bias(score, b, h, q_idx, kv_idx, bias)

    def documents(b, h, q_idx, kv_idx, bias, doc):
        return document_mask(b, h, q_idx, kv_idx, doc)

    aux = (numba_array_type(np.float32, 2), numba_array_type(np.int32, 2))
    return (device_function(biased), device_function(documents)), aux


def merge_configs():
    """Every merge configuration the package can launch on a GPU, for the compile tier."""
    for part_dtype, out_dtype in merge.PAIRS:
        acc_np = acc_dtype(part_dtype)
        yield {
            "name": f"merge THREADS={merge.GPU_THREADS} {part_dtype.name}->{out_dtype.name}",
            "kernel": merge.merge_kernel(merge.GPU_THREADS, part_dtype, out_dtype),
            "args": (numba_array_type(part_dtype, 3), numba_array_type(acc_np, 2),
                     numba_array_type(np.dtype(np.float32), 1), numba_array_type(out_dtype, 2),
                     numba_array_type(acc_np, 1)),
            "float64_ok": part_dtype == np.float64,
        }


def mla_configs():
    """The compile tier's builds: 576 / 512 (DeepSeek's latent cache) in float16 and
    bfloat16, float16 with token-sparse lists (``GATHER``), the token-sparse forward's
    128 / 128 with a value cache of its own (``OWN_V``), and 576 / 512 over an e4m3 latent
    cache (``KV_FP8``, float16 and bfloat16 ``q``: two widenings; sm_89+ for the
    conversions)."""
    from numba_flash.kernels.core.variant import variant_type

    u16_4 = types.Array(types.uint16, 4, "C")
    u16_2 = types.Array(types.uint16, 2, "C")
    i32_1 = types.Array(types.int32, 1, "C")
    i32_2 = types.Array(types.int32, 2, "C")
    f32_1 = types.Array(types.float32, 1, "C")
    va_t = variant_type(types.float32, False, ())
    f32_3 = types.Array(types.float32, 3, "C")
    builds = ([(576, 512, t, False, False, False, False) for t in MMA_DTYPES]
              + [(576, 512, "float16", True, False, False, False),
                 (128, 128, "float16", True, True, False, False),
                 (576, 512, "float16", False, False, True, False),
                 (576, 512, "bfloat16", False, False, True, False),
                 # q and out= views read and written through their strides (layout "A")
                 (576, 512, "float16", False, False, False, True)])
    for d_qk, d_v, dtype, gather, own_v, kv_fp8, strided in builds:
        cfg = mla_decode_config(d_qk, d_v, dtype, gather, own_v, kv_fp8)
        if strided:
            cfg = dataclasses.replace(cfg, STRIDED=True)
        pairs = cfg.BLOCK_N // 16
        o_el = types.float16 if dtype == "float16" else types.uint16
        o_t = types.Array(o_el, 4, "A") if strided else types.Array(o_el, 1, "C")
        q_t = types.Array(types.uint16, 4, "A") if strided else u16_4
        yield {"name": cfg.name, "config": cfg, "kernel": mla.mla_decode_kernel(cfg),
               "args": (q_t, u16_2, i32_2, i32_1, i32_1, o_t, f32_1, f32_1, f32_1, va_t,
                        types.int32, types.int32, types.int32, types.int32,
                        types.UniTuple(types.int64, 3), types.int32, types.int32, types.int32,
                        types.Array(types.int32, 4, "C"), u16_2,
                        f32_3),
               "float64_ok": False, "mma": True,
               **({"cc": fp8.CC} if kv_fp8 else {}),   # e4m3 conversions: sm_89+
               # a key tile, a warp: S (2 mma per B pair and k-step), P V (2 per pair, k-step)
               "sass": {"expect_mma": 2 * pairs * cfg.K_STEPS_W + 2 * (cfg.V_COLS_W // 16)
                        * pairs, "streaming": True}}
