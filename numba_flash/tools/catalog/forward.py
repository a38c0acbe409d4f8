"""The forward kernels' compile-tier configurations: the SIMT forward, mma.sync and wgmma."""

from __future__ import annotations

import dataclasses

import numpy as np

from numba import types
from numba_flash.kernels.core.common import HEAD_DIMS, numba_array_type
from numba_flash.kernels.core.elements import BFLOAT16
from numba_flash.kernels.forward.config import (
    WGMMA_HEAD_DIMS, forward_mma_config, forward_wgmma_config,
)
from numba_flash.kernels.forward import mma
from numba_flash.kernels.forward import config as fconfig
from numba_flash.kernels.forward import simt
from numba_flash.kernels.forward import wgmma


def simt_configs():
    """Every forward configuration the package can launch on a GPU, for the compile tier: the
    default tiles of each compile-time head dim and dtype, for every :func:`kernel_flags`
    (explicit tiles reuse these kernels, see :func:`explicit_tiles`); bfloat16 for
    :data:`BF16_CONFIGS` only; the paged varlen kernels for :data:`PAGED_CONFIGS` only."""
    for dtype in (np.float16, np.float32, np.float64, BFLOAT16):
        dt = np.dtype(dtype)
        for hd in HEAD_DIMS:
            if dt == BFLOAT16 and hd not in simt.BF16_CONFIGS:
                continue
            for dropout, score_mod, varlen in simt.kernel_flags():
                if dt == BFLOAT16 and dropout not in simt.BF16_CONFIGS[hd]:
                    continue
                cfg = fconfig.forward_simt_config(hd, dt, dropout, score_mod, varlen,
                                               vec=dt in simt.VEC_DTYPES, simulator=False)
                yield simt.compile_config(cfg)
    for dt, dims in simt.PAGED_CONFIGS.items():
        for hd in dims:
            yield simt.compile_config(fconfig.forward_simt_config(hd, dt, False, True, True, True,
                                                vec=dt in simt.VEC_DTYPES, simulator=False))
    for dt in (np.dtype(np.float32), np.dtype(np.float64)):  # the element-wise copies
        for varlen in (False, True):
            cfg = fconfig.forward_simt_config(64, dt, False, varlen, varlen, simulator=False)
            yield simt.compile_config(cfg, " elementwise")
    for dt, varlen in ((np.dtype(np.float32), False), (np.dtype(np.float16), True)):
        # a value head dim of its own (OWN_V: V and o at d_v, e.g. 128 beside 192 in HEAD_DIM
        # 256): the float32 batched build and the float16 varlen one
        yield simt.compile_config(fconfig.forward_simt_config(256, dt, False, varlen, varlen,
                                            vec=dt in simt.VEC_DTYPES, simulator=False, own_v=True),
                             " own d_v")
    for dt in (np.dtype(np.float32), np.dtype(np.float16)):
        # read through strides (flash-attn's [B, N, H, d] memory): float32 (cp.async) and
        # float16 (widened element by element)
        yield simt.compile_config(fconfig.forward_simt_config(
            64, dt, vec=dt in simt.VEC_DTYPES, simulator=False, strided=True))
    # the varlen build on packed views (a fused projection's q, k, v slices), and the paged
    # prefill's on packed q and out= views: float32 (cp.async) and float16 (element loads)
    yield simt.compile_config(fconfig.forward_simt_config(
        64, np.dtype(np.float32), False, True, True, vec=True, simulator=False, strided=True))
    for dt in (np.dtype(np.float32), np.dtype(np.float16)):
        yield simt.compile_config(fconfig.forward_simt_config(
            64, dt, False, True, True, True, vec=dt in simt.VEC_DTYPES, simulator=False,
            strided=True))
    yield from _user_configs()


def _user_configs():
    """A user's variant (:mod:`numba_flash.flex.examples`: a relative-position bias score_mod and
    a document mask_mod with a block mask) at float32 HEAD_DIM 64, batched and in the paged
    prefill: the device build of user functions called with ``*aux`` from the score stage (the
    rows above are the build without them)."""
    from numba_flash.flex.examples import document_mask, relative_bias
    from numba_flash.flex.functions import device_function

    def biased(score, b, h, q_idx, kv_idx, bias, doc):  # every function gets every aux array
        return relative_bias(score, b, h, q_idx, kv_idx, bias)

    def documents(b, h, q_idx, kv_idx, bias, doc):
        return document_mask(b, h, q_idx, kv_idx, doc)

    dt = np.dtype(np.float32)
    user = (device_function(biased), device_function(documents), (128, 128))
    user_t = (types.Array(types.int8, 4, "C"), numba_array_type(np.float32, 2),
              numba_array_type(np.int32, 2))
    # the batched build, and the paged prefill (varlen + paged: every address path at once)
    for varlen in (False, True):
        cfg = fconfig.forward_simt_config(64, dt, False, True, varlen, varlen, vec=True, user=user,
                             tiles=fconfig.gpu_tiles(64, dt), simulator=False)
        yield simt.compile_config(cfg, " score_mod mask_mod block_mask", user_t)


def mma_configs():
    """A representative set for the compile tier (the flags multiply: 5 head dims x dropout x
    softcap x ALiBi = 40 kernels would take minutes), all from the tile choices of
    :data:`~numba_flash.kernels.forward.config.FORWARD_MMA_TILES`: every head dim plain, every flag
    at once at 128 and 256 (the largest register and shared-memory footprints), the 16-bit-load
    build (``VEC`` off: ``d < HEAD_DIM`` or unaligned inputs) at 64 and, with every flag, 128;
    bfloat16 at 64 plain and 128 with every flag; a user's variant at 64; a value head dim of
    its own, (192, 128): K tiles 192 wide, V tiles 128 (``OWN_V``).  Causal and windows
    are run-time arguments: every configuration covers them."""
    every = dict(DROPOUT=True, SOFTCAP=True, ALIBI=True)
    plan = [forward_mma_config(hd, simulator=False) for hd in HEAD_DIMS]
    plan += [forward_mma_config(hd, simulator=False, **every) for hd in (128, 256)]
    plan += [forward_mma_config(64, simulator=False, VEC=False),
             forward_mma_config(128, simulator=False, VEC=False, **every)]
    plan += [forward_mma_config(64, "bfloat16", simulator=False),
             forward_mma_config(128, "bfloat16", simulator=False, **every)]
    # (d, d_v) = (192, 128), DeepSeek's MLA prefill: K and Q tiles 192 wide, V tiles 128
    plan += [forward_mma_config(192, simulator=False, head_dim_v=128)]
    plan += [forward_mma_config(64, simulator=False, USER=_user_build())]
    # read through strides (flash-attn's [B, N, H, d] memory, fused QKV slices): the goal
    # head dims
    plan += [forward_mma_config(hd, simulator=False, STRIDED=True) for hd in (64, 128)]
    for cfg in plan:
        yield mma.compile_config(cfg)


def _user_build():
    """A user's variant (:mod:`numba_flash.flex.examples`: a relative-position bias score_mod and
    a document mask_mod with a block mask) as device functions: the build of user functions
    called with ``*aux`` (every function gets every aux array)."""
    from numba_flash.flex.examples import document_mask, relative_bias
    from numba_flash.flex.functions import device_function

    def biased(score, b, h, q_idx, kv_idx, bias, doc):
        return relative_bias(score, b, h, q_idx, kv_idx, bias)

    def documents(b, h, q_idx, kv_idx, bias, doc):
        return document_mask(b, h, q_idx, kv_idx, doc)

    return (device_function(biased), device_function(documents), (128, 128))


def wgmma_configs():
    """The compile tier's builds, for sm_90a: d = 64 and 128 plain, each also with the other
    choice of ``OVERLAP``; bfloat16 at 64; every flag at once at 128; the 16-bit-load build at
    64; a user's variant at 64; the strided builds at 64 and 128."""

    every = dict(DROPOUT=True, SOFTCAP=True, ALIBI=True)
    plan = [forward_wgmma_config(hd, simulator=False) for hd in WGMMA_HEAD_DIMS]
    # the tile table's alternatives (kernels/forward/config.py says why it chose as it did)
    plan += [dataclasses.replace(c, OVERLAP=not c.OVERLAP) for c in plan]
    plan += [forward_wgmma_config(64, "bfloat16", simulator=False),
             forward_wgmma_config(128, simulator=False, **every),
             forward_wgmma_config(64, simulator=False, VEC=False),
             forward_wgmma_config(64, simulator=False, USER=_user_build())]
    # read through strides (flash-attn's [B, N, H, d] memory): the goal head dims
    plan += [forward_wgmma_config(hd, simulator=False, STRIDED=True) for hd in (64, 128)]
    for cfg in plan:
        yield wgmma.compile_config(cfg)


def fp8_configs():
    """The e4m3 forward's builds, for sm_89 (its native e4m3 ``mma.sync.m16n8k32``; Hopper
    emulates it): d = 64, 128, 256 with bfloat16 ``o``, 128 with softcap and ALiBi into
    float16, 64 with a user's variant, and the strided builds at 64 and 128."""
    from numba_flash.kernels.forward import fp8

    plan = [fp8.forward_fp8_config(hd) for hd in (64, 128, 256)]
    plan += [fp8.forward_fp8_config(128, "float16", SOFTCAP=True, ALIBI=True),
             fp8.forward_fp8_config(64, USER=_user_build())]
    # read through strides (flash-attn's [B, N, H, d] memory)
    plan += [fp8.forward_fp8_config(hd, STRIDED=True) for hd in (64, 128)]
    for cfg in plan:
        yield {**fp8.compile_config(cfg), "cc": fp8.CC}


def wgmma_fp8_configs():
    """The e4m3 warpgroup forward's builds (sm_90a): the tile table's d = 64, 128, 256 with
    bfloat16 ``o``, 128 with softcap and ALiBi into float16, 64 with a user's variant, and the
    strided build at 128."""
    from numba_flash.kernels.forward import wgmma_fp8

    plan = [wgmma_fp8.forward_wgmma_fp8_config(hd, simulator=False) for hd in (64, 128, 256)]
    plan += [wgmma_fp8.forward_wgmma_fp8_config(128, "float16", simulator=False, SOFTCAP=True,
                                                ALIBI=True),
             wgmma_fp8.forward_wgmma_fp8_config(64, simulator=False, USER=_user_build())]
    # read through strides (flash-attn's [B, N, H, d] memory): the d = 128 goal
    plan += [wgmma_fp8.forward_wgmma_fp8_config(128, simulator=False, STRIDED=True)]
    for cfg in plan:
        yield wgmma_fp8.compile_config(cfg)
