"""The probe kernels' compile-tier configurations: the PTX primitives (mma.sync, copies, wgmma),
the warp GEMM stage and the element round trip."""

from __future__ import annotations

import numpy as np

from numba import types
from numba_flash.kernels.core import elements
from numba_flash.kernels.mainloop import warp_gemm
from numba_flash.kernels.ptx import fp8, mma_fp8
from numba_flash.kernels.ptx import mma
from numba_flash.kernels.ptx import stages
from numba_flash.kernels.ptx import wgmma


def elements_configs():
    """The round-trip kernel of every element type, for the compile tier."""
    from numba_flash.kernels.core.common import acc_dtype, numba_array_type

    for dt in elements.ELEMENT_DTYPES:
        src_t = numba_array_type(acc_dtype(dt), 1)
        yield {"name": f"elements round_trip {dt.name}", "kernel": elements.round_trip_kernel(dt),
               "args": (src_t, numba_array_type(dt, 1), src_t), "float64_ok": dt == np.float64}


def mma_configs():
    """The primitives' own kernels, for the compile tier (they must contain ``mma.sync``)."""
    u16_2 = types.Array(types.uint16, 2, "C")
    f32_2 = types.Array(types.float32, 2, "C")
    u32_2 = types.Array(types.uint32, 2, "C")
    yield {"name": "mma warp_gemm K64", "kernel": mma.warp_gemm_kernel(64),
           "args": (u16_2, u16_2, f32_2, f32_2, u32_2), "float64_ok": False, "mma": True}
    yield {"name": "mma fragment", "kernel": mma.fragment_kernel(),
           "args": (u32_2, f32_2, f32_2), "float64_ok": False, "mma": True}
    yield {"name": "mma warp_gemm K64 bfloat16", "kernel": mma.warp_gemm_kernel(64, "bfloat16"),
           "args": (u16_2, u16_2, f32_2, f32_2, u32_2), "float64_ok": False, "mma": True}
    yield {"name": "mma fragment bfloat16", "kernel": mma.fragment_kernel("bfloat16"),
           "args": (u32_2, f32_2, f32_2), "float64_ok": False, "mma": True}


def stages_configs():
    """The stage kernels for the compile tier (they must build ``ldmatrix``, ``cp.async``)."""
    u16_1 = types.Array(types.uint16, 1, "C")
    types.Array(types.uint16, 2, "C")
    u16_3 = types.Array(types.uint16, 3, "C")
    u32_1 = types.Array(types.uint32, 1, "C")
    u32_2 = types.Array(types.uint32, 2, "C")
    i32_1 = types.Array(types.int32, 1, "C")
    f32_1 = types.Array(types.float32, 1, "C")
    f32_2 = types.Array(types.float32, 2, "C")
    for trans in (False, True):
        yield {"name": f"stages ldmatrix{' trans' if trans else ''}",
               "kernel": stages.ldmatrix_kernel(trans), "args": (u32_1, i32_1, u32_2),
               "float64_ok": False}
    for vec in (True, False):
        yield {"name": f"stages tile_copy R32 D64{' vec' if vec else ''}",
               "kernel": stages.tile_copy_kernel(32, 64, 128, vec, 3),
               "args": (u16_1, u16_3, types.int32, types.int32, i32_1), "float64_ok": False}
    yield {"name": "stages tile_copy R32 D64 vec bfloat16",
           "kernel": stages.tile_copy_kernel(32, 64, 128, True, 3, "bfloat16"),
           "args": (u16_1, u16_3, types.int32, types.int32, i32_1), "float64_ok": False}
    yield {"name": "stages arith", "kernel": stages.arith_kernel(), "args": (f32_1, f32_1, f32_2),
           "float64_ok": False}
    yield {"name": "stages red_add", "kernel": stages.red_add_kernel(),
           "args": (f32_2, i32_1, f32_1), "float64_ok": False}
    f16_2 = types.Array(types.float16, 2, "C")
    yield {"name": "stages load16 float16", "kernel": stages.load16_kernel(8),
           "args": (f16_2, i32_1, f32_2), "float64_ok": False}


def fp8_configs():
    """The fp8 probe: four e4m3 of a word to float32 and a float32 to e4m3
    (``cvt.rn.f16x2.e4m3x2``, ``cvt.rn.satfinite.e4m3x2.f32``: sm_89+, so built for sm_90
    alone)."""
    yield {"name": "fp8 e4m3 conversions", "kernel": fp8.e4m3_probe_kernel(), "cc": fp8.CC,
           "args": (types.Array(types.uint32, 1, "C"), types.Array(types.float32, 2, "C"),
                    types.Array(types.float32, 1, "C"), types.Array(types.uint8, 1, "C"),
                    types.Array(types.uint32, 2, "C")),
           "float64_ok": False}
    u32_2 = types.Array(types.uint32, 2, "C")
    f32_2 = types.Array(types.float32, 2, "C")
    yield {"name": "fp8 warp_gemm e4m3 K64", "kernel": mma_fp8.warp_gemm_e4m3_kernel(64),
           "cc": fp8.CC, "args": (u32_2, u32_2, f32_2, f32_2), "float64_ok": False}


def warp_gemm_configs():
    """The stage's own kernel for the compile tier (:func:`warp_gemm_kernel`: it must build
    ``ldmatrix``, ``cp.async`` and ``mma.sync``)."""
    from numba import types

    u16_2 = types.Array(types.uint16, 2, "C")
    f32_2 = types.Array(types.float32, 2, "C")
    for m_tiles, a_src in ((2, "smem"), (2, "regs")):
        yield {"name": f"warp_gemm M{16 * m_tiles} K64 N32 A={a_src}",
               "kernel": warp_gemm.warp_gemm_kernel(m_tiles, 64, 32, "float16", a_src),
               "args": (u16_2, u16_2, u16_2, f32_2, f32_2), "float64_ok": False, "mma": True}


def wgmma_configs():
    """The probe kernels for the compile tier, built for sm_90a (``"cc"``): every ``N`` of
    :data:`WGMMA_N`, both element types, SS and RS, both majors of ``B``, every swizzle.
    ``"hgmma"``: the ``HGMMA`` instructions each must assemble to, ``(N, count)``."""
    u16_2 = types.Array(types.uint16, 2, "C")
    f32_2 = types.Array(types.float32, 2, "C")
    gemm = (u16_2, u16_2, f32_2, f32_2)
    for N, K, dtype, sw, a_src, major, wgs in (
            (64, 64, "float16", 128, "smem", "K", 2), (128, 64, "bfloat16", 128, "regs", "MN", 1),
            (256, 32, "float16", 64, "smem", "K", 1), (32, 32, "bfloat16", 32, "smem", "MN", 1),
            (16, 32, "float16", 0, "regs", "K", 1), (8, 32, "float16", 0, "smem", "MN", 1)):
        yield {"name": f"wgmma gemm W{wgs} N{N} K{K} {a_src} B{major} sw{sw} {dtype}",
               "kernel": wgmma.wgmma_gemm_kernel(N, K, dtype, sw, a_src, major, wgs), "args": gemm,
               "float64_ok": False, "cc": wgmma.CC, "hgmma": ((N, K // 16),),
               "launch_bounds": 128 * wgs}
    for n1, d, dtype in ((64, 64, "float16"), (32, 128, "bfloat16")):
        yield {"name": f"wgmma chain N{n1} D{d} {dtype}", "cc": wgmma.CC,
               "kernel": wgmma.wgmma_chain_kernel(n1, d, d, dtype),
               "args": (u16_2, u16_2, u16_2, f32_2, f32_2), "float64_ok": False,
               "hgmma": ((n1, d // 16), (d, n1 // 16))}
