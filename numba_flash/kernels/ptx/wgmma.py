"""Warpgroup tensor-core stages for Hopper (sm_90a): ``wgmma.mma_async`` and what it needs.

A *warpgroup* (four consecutive warps, threads ``128 w .. 128 w + 127``) issues one
``wgmma.mma_async``: ``D = A B (+ D)`` for ``A`` 64 x 16, ``B`` 16 x ``N`` (16-bit elements, ``N``
a multiple of 8 up to 256) and ``D`` 64 x ``N`` float32.  It is asynchronous: its result may be
read only after a ``wgmma.commit_group`` / ``wgmma.wait_group`` pair says it is complete.  ``B``
comes from shared memory through a 64-bit matrix descriptor, ``A`` the same way (SS) or from
registers (RS).  Every instruction here needs ``sm_90a``: a kernel using them compiles with
``compile_ptx(..., cc=(9, 0, "a"))``; numba-cuda launches with that target on a cc 9.0 device by
itself.

Layouts (PTX ISA): float32 ``d_i`` of warpgroup rank ``r`` (``w = r >> 5``, ``g = (r & 31) >> 2``,
``t = r & 3``) sits at row ``16 w + g + 8 ((i >> 1) & 1)``, column ``8 (i >> 2) + 2 t + (i & 1)``
(:func:`acc_coords`): each 8-column block of a warp's rows is an ``mma.sync`` ``C`` fragment.  The
RS ``A`` registers follow the same formula for ``i < 8`` (:func:`a_coords`), so accumulator columns
``16 j .. 16 j + 15``, packed to 16 bits, are the ``A`` of k-block ``j``.  A shared operand is
K-major or MN-major in the ISA's canonical layouts (:func:`canonical_offsets`), swizzled by byte
address (:func:`swizzle_address`); a :class:`TileLayout` ``(ROWS, COLS, SWIZZLE)`` is one storage
read either way, and :func:`encode_descriptor` / :class:`Descriptor` pack its fields.  The host
checks the constraints (ValueError).

Stages (the kernels call these names; the backend picks the implementation at import):

* :func:`make_wgmma` ``(N, DTYPE, A_SRC, TRANS_A, TRANS_B)`` -> ``mma(smem, a, desc_b, acc,
  scale_d)``: ``a`` a descriptor (``uint64``, SS) or four ``uint32`` (RS), ``acc`` a
  ``UniTuple(float32, N/2)``, ``scale_d`` 0: ``D = A B``, else ``D = A B + acc``; the returned
  accumulator is read only after :func:`wgmma_wait_group` and :func:`fence_operand`;
* :func:`wgmma_fence`, :func:`wgmma_commit_group`, :func:`wgmma_wait_group` ``(N)``,
  :func:`fence_operand` ``(regs)``, :func:`fence_proxy_async`, :func:`tiles_ready`;
* :func:`smem_address`, :func:`align_pad`, :func:`make_desc`, :func:`desc_bits`, :func:`desc_lo`,
  :func:`desc_at`, :func:`warp_uniform`, :func:`make_acc_zeros`, :func:`make_a_from_acc`,
  :func:`make_tile_copy`, :func:`make_tile_scan`;
* the forward's GEMM stage on the ``mma.sync`` fragment view: :func:`make_fragment_view`,
  :func:`make_a_pack`, :func:`make_warpgroup_gemm` -> ``(operands, issue, complete)``.

File: host layouts, descriptors and tiles, GPU intrinsics, simulator twins (the ISA's semantics
for the warpgroup; they raise on what the hardware leaves undefined), device stages, the probe
kernels :func:`wgmma_gemm_kernel`, :func:`wgmma_chain_kernel` (``cc=(9, 0, "a")`` only).  The
layout tables, the order of fences and waits, the twin and the forward on these: docs/wgmma.md.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, types, uint32, uint64

from ...backend import on_simulator
from ..core.jit import device_jit, kernel_jit, static_fold
from . import address, record
from .fp8 import e4m3_to_float64
from .mma import dtype_name, half2_bits, halves_to_float64, mma_ops
from .mma_fp8 import pack_e4m3x4
from .stages import (
    cp_async16, cp_async16_rows, cp_async_commit, cp_async_wait_all, load_u16,
    make_zero_nonfinite_word, wide_mad,
)

#: threads of a warpgroup
WARPGROUP = 128
#: the N of ``m64nNk16`` this module builds and tests (the ISA allows every multiple of 8)
WGMMA_N = (8, 16, 32, 64, 128, 192, 256)
#: swizzle modes, as the bytes of one swizzled row (0: none, the ISA's "interleave")
SWIZZLES = (0, 32, 64, 128)
#: the descriptor's mode field (bits 62-63) of each swizzle
MODE_BITS = {0: 0, 128: 1, 64: 2, 32: 3}
#: the two storage orders of an operand: K contiguous (``imm-trans`` 0) or MN contiguous (1)
MAJORS = ("K", "MN")
#: the compute capability the wgmma kernels compile for
CC = (9, 0, "a")
#: the alignment :func:`align_pad` gives: the 128-byte swizzle's repeating pattern
ARENA_ALIGN = 1024
#: the twin's :func:`smem_address` (16-byte aligned, not 1024: the pad is exercised; the
#: simulator's model of a shared allocation's address, :data:`~numba_flash.kernels.ptx.address.
#: SHARED_BASE`)
SIM_SMEM_BASE = address.SHARED_BASE

_PTX_TYPE = {"float16": "f16", "bfloat16": "bf16", "e4m3": "e4m3"}
#: the element types of :func:`make_wgmma`: the 16-bit pair (``k = 16``) and e4m3 (``k = 32``,
#: both operands K-major: the ISA has no transpose for 8-bit types)
WGMMA_DTYPES = ("float16", "bfloat16", "e4m3")


# ------------------------------------------------------------------------------------------
# fragments as host functions (the docs table, the tests, the twin)
# ------------------------------------------------------------------------------------------
# [docs:wgmma-coords]
def acc_coords(thread, i):
    """(row, col) in the 64 x N accumulator of float ``d_i`` held by warpgroup thread
    ``thread`` (0..127)."""
    w, g, t = thread >> 5, (thread & 31) >> 2, thread & 3
    return 16 * w + g + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * t + (i & 1)


def a_coords(thread, i):
    """(row, col) in the 64 x 16 ``A`` of 16-bit element ``a_i`` (0..7; register ``i >> 1``,
    low half first) held by ``thread``: the accumulator's formula for ``i < 8``."""
    return acc_coords(thread, i)
# [/docs:wgmma-coords]


@functools.lru_cache(maxsize=None)
def acc_tables(N):
    """``(rows, cols)``, int arrays ``[128, N/2]``: :func:`acc_coords` of every thread and
    register (``N = 16`` gives the ``A`` registers' halves)."""
    return acc_coords(np.arange(WARPGROUP)[:, None], np.arange(N // 2)[None, :])


def acc_fragments(d):
    """Per-thread accumulators ``[128, N/2]`` of a 64 x N matrix ``d``."""
    d = np.asarray(d)
    rows, cols = acc_tables(d.shape[1])
    return d[rows, cols]


def matrix_from_acc(frags):
    """The 64 x N matrix whose per-thread accumulators are ``frags [128, N/2]``."""
    frags = np.asarray(frags)
    rows, cols = acc_tables(2 * frags.shape[1])
    out = np.zeros((64, 2 * frags.shape[1]), frags.dtype)
    out[rows, cols] = frags
    return out


def a_fragments(a_bits):
    """Per-thread ``A`` registers ``uint32 [128, 4]`` of 64 x 16 16-bit element bits
    ``a_bits`` (uint16)."""
    rows, cols = acc_tables(16)
    halves = np.ascontiguousarray(np.asarray(a_bits, np.uint16)[rows, cols])
    return halves.view(np.uint32)


# ------------------------------------------------------------------------------------------
# descriptors and shared-memory layouts (host functions; the twin decodes with them)
# ------------------------------------------------------------------------------------------
class Descriptor(NamedTuple):
    """A matrix descriptor's fields, in bytes (``swizzle`` 0, 32, 64 or 128)."""
    start: int
    lbo: int
    sbo: int
    swizzle: int = 0
    base_offset: int = 0


_ADDR = uint32(0x3FFFF)
_U4, _U16, _U32, _U49, _U62 = uint64(4), uint64(16), uint64(32), uint64(49), uint64(62)


# [docs:wgmma-descriptor]
def desc_bits(start, lbo, sbo, mode, base_offset):
    """The 64-bit descriptor: ``matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4`` of the start
    address (bits 0-13), leading byte offset (16-29) and stride byte offset (32-45); the base
    offset (49-51) and the swizzle mode (62-63).  Plain integer code: the host's
    :func:`encode_descriptor` and the device function of the same name run it."""
    return (uint64((uint32(start) & _ADDR) >> uint32(4))
            | (uint64((uint32(lbo) & _ADDR) >> uint32(4)) << _U16)
            | (uint64((uint32(sbo) & _ADDR) >> uint32(4)) << _U32)
            | (uint64(uint32(base_offset) & uint32(7)) << _U49)
            | (uint64(mode) << _U62))
# [/docs:wgmma-descriptor]


def encode_descriptor(start, lbo, sbo, swizzle=0, base_offset=0):
    """The descriptor (a Python int) of a shared-memory operand; ValueError for a field that
    does not fit (addresses and offsets: multiples of 16 below 2**18)."""
    for name, v in (("start", start), ("lbo", lbo), ("sbo", sbo)):
        if not (isinstance(v, (int, np.integer)) and 0 <= v < 2**18 and v % 16 == 0):
            raise ValueError(f"{name}: expected a multiple of 16 in [0, 2**18), got {v!r}")
    if swizzle not in MODE_BITS:
        raise ValueError(f"swizzle: expected one of {tuple(MODE_BITS)} (bytes), got {swizzle!r}")
    if not 0 <= base_offset < 8:
        raise ValueError(f"base_offset: expected 0..7, got {base_offset!r}")
    return int(desc_bits(start, lbo, sbo, MODE_BITS[swizzle], base_offset))


def decode_descriptor(desc):
    """The :class:`Descriptor` fields of a 64-bit descriptor."""
    desc = int(desc)

    def field(lo):
        return ((desc >> lo) & 0x3FFF) << 4

    swizzle = {v: k for k, v in MODE_BITS.items()}[(desc >> 62) & 3]
    return Descriptor(field(0), field(16), field(32), swizzle, (desc >> 49) & 7)


# [docs:wgmma-swizzle]
def swizzle_address(addr, swizzle):
    """The byte address a ``swizzle``-byte mode stores logical address ``addr`` at
    (``Swizzle<log2(swizzle/16), 4, 3>``: the 16-byte chunk bits from bit 4 XOR the bits from
    bit 7); works on NumPy arrays.  ``swizzle`` 0: unchanged."""
    mask = max(swizzle // 16 - 1, 0)
    return addr ^ (((addr >> 7) & mask) << 4)
# [/docs:wgmma-swizzle]


def canonical_offsets(major, swizzle, lbo, sbo, mn, k, elem_bytes=2):
    """Byte offsets ``[mn, k]`` (before the swizzle) of the elements of an ``mn x k`` operand in
    the ISA's canonical layout of ``major`` (``"K"`` or ``"MN"``) and ``swizzle``, with
    ``T = 16 / elem_bytes`` elements a 16-byte chunk (the table in docs/wgmma.md)."""
    T = 16 // elem_bytes
    i = np.arange(mn)[:, None]
    j = np.arange(k)[None, :]
    if major == "K":
        if swizzle == 0:   # ((8,m),(T,2k)):((1T,SBO),(1,LBO))
            off = (i % 8) * 16 + (i // 8) * sbo + (j % T) * elem_bytes + (j // T) * lbo
        else:              # ((8,m),(T,2k)):((W/16 T,SBO),(1,T)): a row is W bytes, K runs on
            off = (i % 8) * swizzle + (i // 8) * sbo + j * elem_bytes
    elif major == "MN":
        if swizzle == 0:   # ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO))
            off = (i % T) * elem_bytes + (i // T) * sbo + (j % 8) * 16 + (j // 8) * lbo
        else:              # ((T,W/16,m),(8,k)):((1,T,LBO),(W/16 T,SBO))
            e = swizzle // elem_bytes
            off = (i % e) * elem_bytes + (i // e) * lbo + (j % 8) * swizzle + (j // 8) * sbo
    else:
        raise ValueError(f"major: expected one of {MAJORS}, got {major!r}")
    return off


def operand_addresses(desc, major, mn, k=16, elem_bytes=2):
    """Byte addresses ``[mn, k]`` of the ``mn x k`` operand that descriptor ``desc`` describes,
    stored ``major``: what the instruction reads.  ValueError for a base offset other than 0 (the
    twin does not model it); :class:`~numba_flash.kernels.ptx.address.MisalignedAddressError`
    (a ValueError too) for a swizzled start that is not in the first row of its repeating
    pattern (with base offset 0 the hardware reads another row's chunks).  Starts, LBO and SBO
    are 16-byte aligned by the encoding (it drops the low four bits)."""
    d = decode_descriptor(desc)
    if d.base_offset:
        raise ValueError(f"descriptor: base offset {d.base_offset} is not modelled; start "
                         "swizzled tiles on their pattern boundary")
    if d.swizzle and d.start % (8 * d.swizzle) >= d.swizzle:
        # the pattern repeats every 8 rows from an 8 x swizzle aligned address: with base offset
        # 0 a start past its first row reads another row's chunks (the ISA's alignment rule)
        raise address.misaligned(f"wgmma descriptor: start {d.start:#x} is not in the first "
                                 f"{d.swizzle}-byte row of its {8 * d.swizzle}-byte aligned "
                                 f"swizzle pattern (base offset 0)")
    off = canonical_offsets(major, d.swizzle, d.lbo, d.sbo, mn, k, elem_bytes)
    return swizzle_address(d.start + off, d.swizzle)


def chunk_offset(row, chunk, ROWS, W):
    """Byte offset in a :class:`TileLayout` tile (``ROWS`` rows, ``W``-byte column blocks) of
    16-byte chunk ``chunk`` of row ``row``: block ``chunk // (W/16)``, then the swizzle on the
    offset (the tile starts on the pattern boundary).  Plain integer code: NumPy arrays on the
    host, the device function :func:`chunk_offset_device` in kernels."""
    per = W // 16
    off = (chunk // per) * (ROWS * W) + row * W + (chunk % per) * 16
    return off ^ (((off >> 7) & (per - 1)) << 4)


class TileLayout(NamedTuple):
    """A ``ROWS x COLS`` tile of 16-bit elements in shared memory, in column blocks of ``W``
    bytes (``SWIZZLE`` bytes, or 16 without swizzle), each ``ROWS`` rows of ``W`` bytes,
    swizzled (module docstring).  ``ROWS`` a multiple of 8, ``2 COLS`` of ``W``; the tile
    starts at a multiple of :attr:`ALIGN` from a 1024-byte boundary."""
    ROWS: int
    COLS: int
    SWIZZLE: int = 128

    def check(self):
        """The layout itself, or ValueError naming what does not fit."""
        if self.SWIZZLE not in SWIZZLES:
            raise ValueError(f"SWIZZLE: expected one of {SWIZZLES}, got {self.SWIZZLE!r}")
        if self.ROWS <= 0 or self.ROWS % 8:
            raise ValueError(f"ROWS: expected a positive multiple of 8, got {self.ROWS}")
        if self.COLS <= 0 or (2 * self.COLS) % self.W:
            raise ValueError(f"COLS: expected a positive multiple of {self.W // 2} (whole "
                             f"{self.W}-byte blocks), got {self.COLS}")
        return self

    @property
    def W(self):
        """Bytes of one row of a column block."""
        return self.SWIZZLE or 16

    @property
    def BYTES(self):
        return self.ROWS * self.COLS * 2

    @property
    def ALIGN(self):
        """The swizzle's repeating pattern (8 rows of a block): the tile's alignment."""
        return 8 * self.W

    def offsets(self):
        """Byte offsets ``[ROWS, COLS]`` of every element."""
        r = np.arange(self.ROWS)[:, None]
        c = np.arange(self.COLS)[None, :]
        return chunk_offset(r, (2 * c) // 16, self.ROWS, self.W) + (2 * c) % 16

    def pack(self, bits):
        """The tile's bytes (``uint16 [BYTES / 2]``) holding the 16-bit element bits ``bits``
        ``[ROWS, COLS]`` (host side of what :func:`make_tile_copy` writes)."""
        out = np.zeros(self.BYTES // 2, np.uint16)
        out[self.offsets() // 2] = np.asarray(bits, np.uint16)
        return out

    def descriptor(self, major, kk, mn0=0, mn=None):
        """``Descriptor(start, lbo, sbo, swizzle)`` (start relative to the tile) of the operand
        k-block ``kk`` (16 wide) starting at MN index ``mn0``, ``mn`` long (for the bounds
        check), reading the tile ``major``: ``"K"`` (rows = MN, columns = K: ``Q``, ``K``) or
        ``"MN"`` (rows = K, columns = MN: a row-major ``V``).  ValueError if it does not fit."""
        self.check()
        W, R = self.W, self.ROWS
        if major == "K":
            span_mn, span_k = R, self.COLS
            if mn0 % 8:
                raise ValueError(f"mn0: expected a multiple of 8 rows, got {mn0}")
            if W == 16:
                d = Descriptor(2 * kk * R * 16 + mn0 * 16, R * 16, 128, 0)
            else:
                block, inner = divmod(32 * kk, W)
                d = Descriptor(block * R * W + inner + mn0 * W, 16, 8 * W, self.SWIZZLE)
        elif major == "MN":
            span_mn, span_k = self.COLS, R
            if (2 * mn0) % W:
                raise ValueError(f"mn0: expected a multiple of {W // 2} columns, got {mn0}")
            block = (2 * mn0) // W
            if W == 16:
                d = Descriptor(16 * kk * 16 + block * R * 16, 128, R * 16, 0)
            else:
                d = Descriptor(16 * kk * W + block * R * W, R * W, 8 * W, self.SWIZZLE)
        else:
            raise ValueError(f"major: expected one of {MAJORS}, got {major!r}")
        if not 0 <= kk < span_k // 16 or mn0 + (mn or 0) > span_mn:
            raise ValueError(f"k-block {kk} / rows {mn0}..{mn0 + (mn or 0)} do not fit a "
                             f"{major}-major read of a {R} x {self.COLS} tile")
        return d

    def desc_hi(self, major):
        """The descriptor with start 0 (a ``uint64``): ``make_desc(addr, hi)`` adds the start."""
        d = self.descriptor(major, 0)
        return np.uint64(encode_descriptor(0, d.lbo, d.sbo, d.swizzle))


# ------------------------------------------------------------------------------------------
# GPU implementations: inline PTX
# ------------------------------------------------------------------------------------------
def _gpu_primitives():
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    try:
        from numba.cuda.core.errors import NumbaTypeError
    except ImportError:  # pragma: no cover - other numba-cuda versions
        from numba.core.errors import NumbaTypeError

    i32, f32 = ir.IntType(32), ir.FloatType()

    def statement(ptx):
        """Codegen of one asm statement without operands: volatile, with a memory clobber (kept
        in order with the other asm statements and with shared-memory accesses)."""
        def codegen(context, builder, sig, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), ptx, "~{memory}",
                                      side_effect=True), [])
            return context.get_dummy_value()

        return codegen

    def bare(ptx):
        @intrinsic
        def stage(typingctx):
            return types.none(), statement(ptx)

        return stage

    @intrinsic
    def wgmma_wait_group(typingctx, n):
        """``wgmma.wait_group.sync.aligned N`` (``N`` a compile-time integer)."""
        if not isinstance(n, types.IntegerLiteral):
            raise NumbaTypeError(f"wgmma_wait_group: expected N as a compile-time integer "
                                 f"constant, got {n}")
        return types.none(n), statement(f"wgmma.wait_group.sync.aligned {n.literal_value};")

    # [docs:wgmma-fence-operand]
    @intrinsic
    def fence_operand(typingctx, regs):
        """``regs`` (a tuple of float32 or uint32) unchanged, through an empty volatile asm that
        reads and writes every register: their producers stay before it, their users after."""
        if not (isinstance(regs, types.UniTuple)
                and regs.dtype in (types.float32, types.uint32)):
            raise NumbaTypeError(f"fence_operand: expected a tuple of float32 or uint32, got "
                                 f"{regs}")
        n = regs.count
        ll = f32 if regs.dtype == types.float32 else i32
        cons = ",".join([("=f" if ll is f32 else "=r")] * n + [str(i) for i in range(n)])

        def codegen(context, builder, sig, args):
            vals = [builder.extract_value(args[0], i) for i in range(n)]
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([ll] * n), [ll] * n), "",
                               cons + ",~{memory}", side_effect=True)
            res = builder.call(asm, vals)
            outs = [builder.extract_value(res, i) for i in range(n)]
            return context.make_tuple(builder, sig.return_type, outs)

        return regs(regs), codegen
    # [/docs:wgmma-fence-operand]

    @intrinsic
    def smem_address(typingctx, smem):
        """The 32-bit shared-window address of ``smem[0]``."""
        if not isinstance(smem, types.Array):
            raise NumbaTypeError(f"smem_address: expected a shared array, got {smem}")

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            shared = builder.addrspacecast(data, ir.PointerType(data.type.pointee, 3))
            return builder.ptrtoint(shared, i32)

        return types.uint32(smem), codegen

    # [docs:wgmma-intrinsic]
    def make_mma(N, ptype, A_SRC, TRANS_A, TRANS_B):
        n = N // 2
        K = 32 if ptype == "e4m3" else 16       # a k-step is 32 bytes either way
        name = f"wgmma m64n{N}k{K} {ptype} {A_SRC}"
        ptx = f"wgmma.mma_async.sync.aligned.m64n{N}k{K}.f32.{ptype}.{ptype}"
        acc_ty = types.UniTuple(types.float32, n)
        a_ty = types.uint64 if A_SRC == "smem" else types.UniTuple(types.uint32, 4)

        @intrinsic
        def mma(typingctx, smem, a, desc_b, acc, scale_d):
            """``acc = A B (+ acc)`` issued by the warpgroup (module docstring)."""
            if not isinstance(smem, types.Array):
                raise NumbaTypeError(f"{name}: expected smem as the shared array, got {smem}")
            if a != a_ty or desc_b != types.uint64:
                raise NumbaTypeError(f"{name}: expected A as {a_ty} and desc_b as uint64, got "
                                     f"{a} and {desc_b}")
            if acc != acc_ty or not isinstance(scale_d, types.Integer):
                raise NumbaTypeError(f"{name}: expected acc as {acc_ty} and scale_d as an "
                                     f"integer, got {acc} and {scale_d}")

            def codegen(context, builder, sig, args):
                a_val, db, acc_val, sd = args[1], args[2], args[3], args[4]   # after smem
                if A_SRC == "smem":
                    a_ops, a_cons, a_txt = [a_val], ["l"], f"${n}"
                else:
                    a_ops = [builder.extract_value(a_val, i) for i in range(4)]
                    a_cons, a_txt = ["r"] * 4, "{" + ", ".join(f"${n + i}" for i in range(4)) + "}"
                ib = n + len(a_ops)  # desc_b, then scale_d
                sd32 = context.cast(builder, sd, sig.args[4], types.int32)
                # the transpose immediates exist for 16-bit types only (e4m3: K-major)
                trans = ("" if ptype == "e4m3" else
                         f", {TRANS_A}, {TRANS_B}" if A_SRC == "smem" else f", {TRANS_B}")
                text = ("{ .reg .pred p; setp.ne.b32 p, $" + str(ib + 1) + ", 0; " + ptx
                        + " {" + ", ".join(f"${i}" for i in range(n)) + "}, " + a_txt
                        + f", ${ib}, p, 1, 1{trans}; }}")
                cons = ",".join(["=f"] * n + a_cons + ["l", "r"] + [str(i) for i in range(n)])
                ins = a_ops + [db, sd32] + [builder.extract_value(acc_val, i) for i in range(n)]
                fnty = ir.FunctionType(ir.LiteralStructType([f32] * n), [x.type for x in ins])
                asm = ir.InlineAsm(fnty, text, cons + ",~{memory}", side_effect=True)
                res = builder.call(asm, ins)
                outs = [builder.extract_value(res, i) for i in range(n)]
                return context.make_tuple(builder, sig.return_type, outs)

            return acc_ty(smem, a, desc_b, acc, scale_d), codegen

        return mma
    # [/docs:wgmma-intrinsic]

    def make_zeros(N):
        ty = types.UniTuple(types.float32, N // 2)

        @intrinsic
        def zeros(typingctx):
            def codegen(context, builder, sig, args):
                return context.make_tuple(builder, ty, [ir.Constant(f32, 0.0)] * (N // 2))

            return ty(), codegen

        return zeros

    @intrinsic
    def desc_pack(typingctx, lo, hi):
        """The ``uint64`` of two ``uint32`` halves (``mov.b64 {lo, hi}``): a descriptor whose
        high word is a constant stays one register pair with no 64-bit arithmetic."""
        if lo != types.uint32 or hi != types.uint32:
            raise NumbaTypeError(f"desc_pack: expected two uint32, got {lo} and {hi}")

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(64), [i32, i32]),
                               "mov.b64 $0, {$1, $2};", "=l,r,r")
            return builder.call(asm, list(args))

        return types.uint64(lo, hi), codegen

    return dict(wgmma_fence=bare("wgmma.fence.sync.aligned;"),
                wgmma_commit_group=bare("wgmma.commit_group.sync.aligned;"),
                fence_proxy_async=bare("fence.proxy.async.shared::cta;"),
                wgmma_wait_group=wgmma_wait_group, fence_operand=fence_operand,
                smem_address=smem_address, make_mma=make_mma, make_zeros=make_zeros,
                desc_pack=desc_pack)


# ------------------------------------------------------------------------------------------
# simulator twins
# ------------------------------------------------------------------------------------------
class _ThreadState:
    """One simulated thread's wgmma bookkeeping."""

    def __init__(self):
        self.fenced = False   # a wgmma_fence since the last wait_group
        self.open = []        # issued, not committed
        self.groups = []      # committed groups, oldest first
        self.done = weakref.WeakSet()  # ops this thread has waited for (kept by accumulators)
        self.issued = 0       # mma_async calls so far (the key of the warpgroup's shared op)


def _thread_state():
    t = threading.current_thread()
    st = getattr(t, "_numba_flash_wgmma", None)
    if st is None:
        st = t._numba_flash_wgmma = _ThreadState()
    return st


def _arena(smem):
    """The shared arena as 16-bit words (byte address ``b`` of the twin is word ``b // 2``
    after ``SIM_SMEM_BASE``)."""
    return np.asarray(smem).reshape(-1).view(np.uint16)


def _read(smem, addrs):
    """16-bit words at byte addresses ``addrs`` (twin addresses) of the arena."""
    words = _arena(smem)
    idx = (np.asarray(addrs) - SIM_SMEM_BASE) // 2
    if idx.min() < 0 or idx.max() >= words.size:
        raise ValueError(f"wgmma: a descriptor reads bytes {int(np.min(addrs)):#x}.."
                         f"{int(np.max(addrs)):#x} outside the shared arena "
                         f"[{SIM_SMEM_BASE:#x}, {SIM_SMEM_BASE + 2 * words.size:#x})")
    return words[idx]


def _to_float64(words, dtype):
    """16-bit words (an even number a row) as float64 elements: one a word, or for ``"e4m3"``
    two (low byte first: ``[rows, 2 cols]``)."""
    if dtype == "e4m3":
        return e4m3_to_float64(np.ascontiguousarray(words, np.uint16).view(np.uint8))
    return halves_to_float64(np.ascontiguousarray(words, np.uint16).view(np.uint32), dtype)


@functools.lru_cache(maxsize=None)
def a8_tables():
    """``(rows, cols)``, int arrays ``[128, 16]``: the element of the 64 x 32 8-bit ``A`` in
    byte ``i`` (register ``i >> 2``, byte ``i & 3``) of warpgroup thread ``r`` (CUTLASS's
    ``ALayout_64x32``; per warp the ``mma.m16n8k32`` ``A`` layout of
    :mod:`~numba_flash.kernels.ptx.mma_fp8`): row ``16 w + g + 8 ((i >> 2) & 1)``, column
    ``4 t + (i & 3) + 16 (i >> 3)``."""
    r = np.arange(WARPGROUP)[:, None]
    i = np.arange(16)[None, :]
    w, g, t = r >> 5, (r & 31) >> 2, r & 3
    return 16 * w + g + 8 * ((i >> 2) & 1), 4 * t + (i & 3) + 16 * (i >> 3)


class _Op:
    """One ``wgmma.mma_async`` of a warpgroup: its operands at issue, its product at
    completion (the first wait that covers it)."""

    def __init__(self, spec, smem, a, desc_b):
        self.spec, self.smem, self.lock = spec, smem, threading.Lock()
        N, dtype = spec["N"], spec["dtype"]
        self.b_addr = operand_addresses(desc_b, "MN" if spec["trans_b"] else "K", N).T
        self.a_addr = None
        if record.RECORDER is not None:   # recording mode: the operands' shared reads
            if spec["a_src"] == "smem":
                record.RECORDER.wgmma_operand(
                    smem, operand_addresses(a, "MN" if spec["trans_a"] else "K", 64))
            record.RECORDER.wgmma_operand(smem, self.b_addr.T)
            smem = self.smem = record.raw(smem)
        if spec["a_src"] == "smem":
            self.a_addr = operand_addresses(a, "MN" if spec["trans_a"] else "K", 64)
            a_words = _read(smem, self.a_addr)
        elif dtype == "e4m3":  # a: every thread's four registers of four bytes
            rows, cols = a8_tables()
            a_bytes = np.zeros((64, 32), np.uint8)
            a_bytes[rows, cols] = np.array(a, np.uint32).view(np.uint8).reshape(128, 16)
            a_words = a_bytes.view(np.uint16)
        else:  # a: every thread's four registers
            rows, cols = acc_tables(16)
            a_words = np.zeros((64, 16), np.uint16)
            a_words[rows, cols] = np.array(a, np.uint32).view(np.uint16).reshape(128, 8)
        self.a_words, self.b_words = a_words, _read(smem, self.b_addr)
        # B [k, N]: e4m3 bytes are decoded along each column's words (its K-major row)
        self.a = _to_float64(a_words, dtype)
        self.b = (_to_float64(self.b_words.T, dtype).T if dtype == "e4m3" else
                  _to_float64(self.b_words, dtype))
        self.d = None

    def complete(self):
        with self.lock:
            if self.d is not None:
                return
            if (self.a_addr is not None and not np.array_equal(_read(self.smem, self.a_addr),
                                                               self.a_words)) \
                    or not np.array_equal(_read(self.smem, self.b_addr), self.b_words):
                raise RuntimeError("wgmma: shared memory read by a pending wgmma.mma_async "
                                   "changed before the wgmma_wait_group that completes it")
            with np.errstate(invalid="ignore", over="ignore"):
                self.d = self.a @ self.b


class _Pending(tuple):
    """An accumulator whose ``mma`` has not been waited for: NaN until :func:`fence_operand`
    after the wait returns its values."""

    def resolve(self, st):
        if self.op not in st.done:
            raise RuntimeError("wgmma: accumulator read before a wgmma_wait_group that "
                               "completes its wgmma.mma_async (then fence_operand)")
        rows, cols = acc_tables(self.op.spec["N"])
        d = self.op.d[rows[self.rank], cols[self.rank]]
        if self.scale_d:
            c = self.c.resolve(st) if isinstance(self.c, _Pending) else self.c
            with np.errstate(invalid="ignore", over="ignore"):
                d = d + np.asarray(c, np.float64)
        return tuple(np.float32(x) for x in d)


def _sim_mma(spec, smem, a, desc_b, acc, scale_d):
    from ... import simulator_warp

    st = _thread_state()
    n = spec["N"] // 2
    if len(acc) != n:
        raise TypeError(f"wgmma m64n{spec['N']}: expected acc as {n} float32, got {len(acc)}")
    if not st.fenced:
        raise RuntimeError("wgmma: mma_async without a wgmma_fence() since this thread's last "
                           "wgmma_wait_group")
    mine = int(a) if spec["a_src"] == "smem" else tuple(int(x) for x in a)
    vals = simulator_warp.exchange((mine, int(desc_b)), WARPGROUP)
    if len(vals) != WARPGROUP:
        raise RuntimeError(f"wgmma: needs a full warpgroup of 128 threads, got {len(vals)}")
    if spec["a_src"] == "smem" and len({v[0] for v in vals}) != 1 \
            or len({v[1] for v in vals}) != 1:
        raise RuntimeError("wgmma: the matrix descriptors differ across the warpgroup")
    key = st.issued
    st.issued += 1
    with simulator_warp.group_lock(WARPGROUP):
        ops = simulator_warp.group_shared(WARPGROUP)
        entry = ops.get(key)
        if entry is None:
            a_all = vals[0][0] if spec["a_src"] == "smem" else [v[0] for v in vals]
            entry = ops[key] = [_Op(spec, smem, a_all, vals[0][1]), 0]
        entry[1] += 1
        op = entry[0]
        if entry[1] == WARPGROUP:
            del ops[key]
    st.open.append(op)
    out = _Pending((np.float32(np.nan),) * n)
    out.op, out.rank, out.c, out.scale_d = op, simulator_warp.lane_id(WARPGROUP), acc, scale_d
    return out


def _sim_wgmma_fence():
    _thread_state().fenced = True


def _sim_wgmma_commit_group():
    st = _thread_state()
    st.groups.append(st.open)
    st.open = []


def _sim_wgmma_wait_group(n):
    st = _thread_state()
    while len(st.groups) > int(n):
        for op in st.groups.pop(0):
            op.complete()
            st.done.add(op)
    st.fenced = False


def _sim_fence_operand(regs):
    if isinstance(regs, _Pending):
        return regs.resolve(_thread_state())
    return regs


def _sim_fence_proxy_async():
    """Twin of ``fence.proxy.async``: the twin's shared memory has one proxy."""


def _sim_smem_address(smem):
    """The shared address of ``smem[0]`` (the allocation at :data:`SIM_SMEM_BASE`)."""
    return uint32(address.shared_address(smem))


def _sim_desc_pack(lo, hi):
    return uint64((int(hi) << 32) | int(lo))


def _sim_warp_uniform(x):
    return x


def _gpu_warp_uniform(x):
    return cuda.shfl_sync(0xFFFFFFFF, x, 0)


if on_simulator():
    wgmma_fence = _sim_wgmma_fence
    wgmma_commit_group = _sim_wgmma_commit_group
    wgmma_wait_group = _sim_wgmma_wait_group
    fence_operand = _sim_fence_operand
    fence_proxy_async = _sim_fence_proxy_async
    smem_address = _sim_smem_address
    desc_pack, warp_uniform = _sim_desc_pack, _sim_warp_uniform
    _GPU = None
else:
    _GPU = _gpu_primitives()
    wgmma_fence, wgmma_commit_group = _GPU["wgmma_fence"], _GPU["wgmma_commit_group"]
    wgmma_wait_group, fence_operand = _GPU["wgmma_wait_group"], _GPU["fence_operand"]
    fence_proxy_async, smem_address = _GPU["fence_proxy_async"], _GPU["smem_address"]
    desc_pack = _GPU["desc_pack"]
    # lane 0's value: the same in every lane, and the compiler knows it (a uniform register):
    # a warpgroup's descriptors stay in the uniform datapath (CUTLASS's canonical_warp_group_idx)
    warp_uniform = device_jit(inline=True)(_gpu_warp_uniform)


@functools.lru_cache(maxsize=None)
def make_wgmma(N, DTYPE="float16", A_SRC="smem", TRANS_A=0, TRANS_B=0):
    """``mma(smem, a, desc_b, acc, scale_d)``: one ``wgmma.mma_async...m64nNk16.f32`` of
    ``DTYPE`` (``"float16"`` / ``"bfloat16"``) operands, or ``m64nNk32`` of ``"e4m3"`` ones
    (32 bytes a k-step, as 16 16-bit elements: the same descriptors), ``A`` from shared memory
    (``A_SRC`` ``"smem"``, ``a`` a descriptor) or registers (``"regs"``, ``a`` four ``uint32``:
    two 16-bit or four e4m3 elements each, :func:`a8_tables`), read MN-major when ``TRANS_A`` /
    ``TRANS_B`` is 1 (16-bit only; module docstring)."""
    dtype = "e4m3" if DTYPE == "e4m3" else dtype_name(DTYPE)
    if dtype == "e4m3" and (TRANS_A or TRANS_B):
        raise ValueError("TRANS_A, TRANS_B: e4m3 operands are K-major only (0), got "
                         f"{TRANS_A!r}, {TRANS_B!r}")
    if N not in WGMMA_N:
        raise ValueError(f"N: expected one of {WGMMA_N}, got {N!r}")
    if A_SRC not in ("smem", "regs"):
        raise ValueError(f"A_SRC: expected 'smem' or 'regs', got {A_SRC!r}")
    if TRANS_A not in (0, 1) or TRANS_B not in (0, 1) or (TRANS_A and A_SRC == "regs"):
        raise ValueError(f"TRANS_A, TRANS_B: expected 0 or 1 (TRANS_A 0 for A from registers), "
                         f"got {TRANS_A!r}, {TRANS_B!r}")
    if _GPU is not None:
        return _GPU["make_mma"](N, _PTX_TYPE[dtype], A_SRC, TRANS_A, TRANS_B)
    spec = dict(N=N, dtype=dtype, a_src=A_SRC, trans_a=TRANS_A, trans_b=TRANS_B)
    return functools.partial(_sim_mma, spec)


@functools.lru_cache(maxsize=None)
def make_acc_zeros(N):
    """``zeros()``: an accumulator tuple of ``N / 2`` float32 zeros."""
    if _GPU is not None:
        return _GPU["make_zeros"](N)
    return lambda: (np.float32(0.0),) * (N // 2)


# ------------------------------------------------------------------------------------------
# plain device functions (the same source runs in both backends)
# ------------------------------------------------------------------------------------------
_device = functools.partial(device_jit, inline=True)

desc_bits_device = _device(desc_bits)
acc_coords_device = _device(acc_coords)
chunk_offset_device = _device(chunk_offset)
_ALIGN_MASK = uint32(ARENA_ALIGN - 1)


@_device
def make_desc(addr, hi):
    """The descriptor of the operand starting at shared address ``addr`` whose other fields are
    ``hi`` (:meth:`TileLayout.desc_hi`)."""
    return uint64(hi | uint64((uint32(addr) & _ADDR) >> uint32(4)))


_LOW32 = uint64(0xFFFFFFFF)


@_device
def desc_lo(addr, hi):
    """The low word of :func:`make_desc` ``(addr, hi)`` (start field and LBO)."""
    return uint32(make_desc(addr, hi) & _LOW32)


@_device
def desc_at(lo, step, hi):
    """The descriptor whose low word is ``lo + step`` (a start ``step`` 16-byte units on) and
    whose high word is ``hi``'s: one 32-bit add, the high word a constant."""
    return desc_pack(uint32(lo + step), uint32(hi >> _U32))


@_device
def align_pad(smem):
    """Bytes from ``smem[0]`` to the next 1024-byte aligned shared address (0..1008)."""
    return uint32(uint32(ARENA_ALIGN) - (smem_address(smem) & _ALIGN_MASK)) & _ALIGN_MASK


@functools.lru_cache(maxsize=None)
def make_a_from_acc(DTYPE="float16"):
    """``a_from_acc(acc, j)``: the four ``A`` registers of k-block ``j`` from accumulator
    columns ``16 j .. 16 j + 15`` (``d_8j .. d_8j+7``), rounded to ``DTYPE`` (module
    docstring: the layouts agree)."""
    _mma, pack2 = mma_ops(DTYPE)

    @_device
    def a_from_acc(acc, j):
        b = 8 * j
        return (pack2(acc[b], acc[b + 1]), pack2(acc[b + 2], acc[b + 3]),
                pack2(acc[b + 4], acc[b + 5]), pack2(acc[b + 6], acc[b + 7]))

    return a_from_acc


@functools.lru_cache(maxsize=None)
def make_tile_copy(LAYOUT, THREADS, VEC=True, STRIDED=False):
    """``copy_tile(smem, tile_byte, src, elem_base, row_stride, rows_valid, cols_valid, tid)``:
    the ``ROWS x COLS`` tile whose row ``r`` starts at element ``elem_base + r row_stride`` of
    ``src`` (16-bit bits, any shape, C-contiguous) into the :class:`TileLayout` ``LAYOUT`` at
    arena byte ``tile_byte`` (a multiple of ``LAYOUT.ALIGN`` past a 1024-byte boundary); rows
    ``>= rows_valid`` as zeros.  ``VEC``: one ``cp.async`` of 16 bytes per chunk (the rows
    16-byte aligned and whole: the caller commits and waits); else 16-bit loads with columns
    ``>= cols_valid`` zero, stored as words.  Thread ``tid`` of ``THREADS`` takes chunks
    ``tid, tid + THREADS, ...`` in row-major order.

    When the chunks of a row divide ``THREADS`` and a thread's rows lie a multiple of 8 apart
    (``STEP``; or the tile is unswizzled), its chunk column and its rows' swizzle are the same
    for all its chunks: the offsets are the first chunk's plus constants, and a full tile
    (``rows_valid >= ROWS``) copies without a row test (the kernels' K / V tiles).  ``STRIDED``
    (``row_stride`` a run-time int32): a row's address is one ``IMAD.WIDE`` from the first's
    (:func:`~numba_flash.kernels.ptx.stages.cp_async16_rows`), not a 64-bit multiply-add."""
    ROWS, COLS = LAYOUT.check().ROWS, LAYOUT.COLS
    W = LAYOUT.W
    CHUNKS = COLS // 8
    TOTAL = ROWS * CHUNKS
    COPIES = -(-TOTAL // THREADS)
    EXACT = TOTAL % THREADS == 0
    STEP = THREADS // CHUNKS if THREADS % CHUNKS == 0 else 0   # rows between a thread's chunks
    FIXED = (VEC and STEP > 0 and ROWS % STEP == 0
             and (STEP % 8 == 0 or LAYOUT.SWIZZLE == 0 or COPIES == 1))

    @_device
    def copy_fixed(smem, tile_byte, src, elem_base, row_stride, rows_valid, cols_valid, tid):
        row0 = int32(tid) // int32(CHUNKS)     # 32-bit: the row tests one instruction each
        ch = int32(tid) % int32(CHUNKS)
        dst0 = tile_byte + chunk_offset_device(row0, ch, ROWS, W)
        if STRIDED:
            src0 = wide_mad(row0, row_stride, elem_base + 8 * ch)
        else:
            src0 = elem_base + row0 * row_stride + 8 * ch
        if rows_valid >= ROWS:      # full tile: no per-row test
            for i in range(ROWS // STEP):
                if STRIDED:
                    cp_async16_rows(smem, dst0 + i * STEP * W, src, src0, row_stride, i * STEP,
                                    0)
                else:
                    cp_async16(smem, dst0 + i * STEP * W, src, src0 + i * STEP * row_stride, 16)
        else:                       # boundary tile: rows past the end read nothing
            for i in range(ROWS // STEP):
                ok = row0 + i * STEP < rows_valid
                cp_async16(smem, dst0 + i * STEP * W, src,
                           src0 + i * STEP * row_stride if ok else elem_base, 16 if ok else 0)

    @_device
    def copy_tile(smem, tile_byte, src, elem_base, row_stride, rows_valid, cols_valid, tid):
        for i in range(COPIES):
            idx = tid + i * THREADS
            if EXACT or idx < TOTAL:
                row = idx // CHUNKS
                ch = idx % CHUNKS
                dst = tile_byte + chunk_offset_device(row, ch, ROWS, W)
                base = elem_base + row * row_stride + 8 * ch
                if VEC:
                    ok = row < rows_valid
                    cp_async16(smem, dst, src, base if ok else elem_base, 16 if ok else 0)
                else:
                    for w in range(4):
                        c = 8 * ch + 2 * w
                        lo = uint32(0)
                        hi = uint32(0)
                        if row < rows_valid and c < cols_valid:
                            lo = uint32(load_u16(src, base + 2 * w))
                        if row < rows_valid and c + 1 < cols_valid:
                            hi = uint32(load_u16(src, base + 2 * w + 1))
                        smem[(dst >> 2) + w] = half2_bits(lo, hi)

    return copy_fixed if FIXED else copy_tile


# ------------------------------------------------------------------------------------------
# the warpgroup GEMM stage: the mma.sync fragment view in and out (the kernels' stages)
# ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def make_fragment_view(N):
    """``(to_tuple, from_tuple)`` between a thread's ``m64nNk16`` accumulator (a
    ``UniTuple(float32, N / 2)``) and the :mod:`~numba_flash.kernels.mainloop.warp_gemm` fragment
    view ``v`` (float32 ``[2, N / 4]``, one 16-row tile): ``d_i`` is ``v[(i >> 1) & 1, 2 (i >> 2) +
    (i & 1)]``, the same row and column (:func:`acc_coords` against ``ACC_ROWS`` /
    ``ACC_COLS``), so the ``mma.sync`` kernels' score, softmax and epilogue stages run on it.
    Straight-line code (generated: a tuple is built and read by constant indices only), so both
    sides stay in registers."""
    cells = [f"v[{(i >> 1) & 1}, {2 * (i >> 2) + (i & 1)}]" for i in range(N // 2)]
    src = ("def to_tuple(v):\n    return (" + ", ".join(cells) + ",)\n\n\n"
           "def from_tuple(d, v):\n"
           + "".join(f"    {c} = d[{i}]\n" for i, c in enumerate(cells)))
    ns = {}
    exec(compile(src, f"<wgmma fragment view N={N}>", "exec"), ns)
    return _device(ns["to_tuple"]), _device(ns["from_tuple"])


@functools.lru_cache(maxsize=None)
def make_a_pack(K_STEPS, DTYPE="float16", P_SCALE=1.0):
    """``(a_pack, a_words)``: ``a_pack(v, pa)`` packs the ``A`` registers of all ``K_STEPS``
    k-blocks of the fragment view ``v`` (float32 ``[2, 4 K_STEPS]``, rounded to ``DTYPE``)
    into ``pa`` (uint32 ``[4 K_STEPS]``; k-block ``j``: ``pa[4 j .. 4 j + 3]``, the order of
    :func:`make_a_from_acc` and ``warp_gemm``'s ``"acc"`` packing); ``a_words(pa)`` is ``pa``
    as one ``UniTuple(uint32, 4 K_STEPS)``, so that one :func:`fence_operand` and one
    :func:`wgmma_fence` order them all before the first ``mma``.  Generated straight-line
    code, as :func:`make_fragment_view`: constant indices only.

    ``"e4m3"``: a k-block is 32 keys (``v``'s columns ``8 j .. 8 j + 7``); each register packs
    four of the lane's own columns times ``P_SCALE`` (``warp_gemm``'s e4m3 packing: keys in
    :func:`~numba_flash.kernels.ptx.mma_fp8.p_key_of_k` order, which ``B`` must share)."""
    lines = []
    if DTYPE == "e4m3":
        pack2 = None
        for j in range(K_STEPS):
            c = 8 * j
            for q, (r, cc) in enumerate(((0, c), (1, c), (0, c + 4), (1, c + 4))):
                vals = ", ".join(f"v[{r}, {cc + e}] * PS" for e in range(4))
                lines.append(f"    pa[{4 * j + q}] = pack4({vals})\n")
    else:
        _mma, pack2 = mma_ops(DTYPE)
        for j in range(K_STEPS):
            c = 4 * j
            for q, (r, cc) in enumerate(((0, c), (1, c), (0, c + 2), (1, c + 2))):
                lines.append(f"    pa[{4 * j + q}] = pack2(v[{r}, {cc}], v[{r}, {cc + 1}])\n")
    src = ("def a_pack(v, pa):\n" + "".join(lines) + "\n\n"
           "def a_words(pa):\n    return (" + ", ".join(f"pa[{i}]" for i in range(4 * K_STEPS))
           + ",)\n")
    ns = {"pack2": pack2, "pack4": pack_e4m3x4, "PS": float32(P_SCALE)}
    exec(compile(src, f"<wgmma A registers K_STEPS={K_STEPS} {DTYPE}>", "exec"), ns)
    return _device(ns["a_pack"]), _device(ns["a_words"])


# [docs:warpgroup-gemm]
@functools.lru_cache(maxsize=None)
def make_warpgroup_gemm(N, B_LAYOUT, B_MAJOR, DTYPE="float16", A_LAYOUT=None, ACCUMULATE=True):
    """``(operands, issue, complete)``: the warpgroup's ``acc (+)= A B`` on ``wgmma``,
    asynchronously, in three calls:

    * ``operands(acc, a) -> (d, ra)``: the accumulator tuple (from ``acc``, the thread's
      fragment view float32 ``[2, N / 4]`` of :func:`make_fragment_view`: the warp's 16 rows
      of the warpgroup's 64; zeros without ``ACCUMULATE``) and, RS, ``A``'s registers from the
      packed ``a`` (uint32 ``[K / 4]``, :func:`make_a_pack`), fenced.  Call it before any
      ``wgmma`` that is in flight when this one issues: ptxas serializes every ``wgmma`` of a
      pipeline stage in which ordinary instructions write a ``wgmma``'s input registers;
    * ``issue(d, ra, smem, a_addr, b_addr) -> d``: the ``K / 16`` ``wgmma`` as one commit group;
      the returned tuple is in flight;
    * ``complete(d, acc)``: after a :func:`wgmma_wait_group` that covers the group, the product
      into ``acc``.  Until then neither ``acc``'s tuple nor ``A``'s registers may change.

    ``B`` (``K x N``) in the :class:`TileLayout` ``B_LAYOUT`` at shared address ``b_addr``, read
    ``B_MAJOR`` (``"K"``: ``N`` rows of ``K``, a K tile; ``"MN"``: ``K`` rows of ``N``, a V
    tile); ``A`` (``64 x K``) from the ``A_LAYOUT`` tile at shared address ``a_addr`` (SS;
    ``a`` unused), or with ``A_LAYOUT`` None from registers (RS, ``P`` for ``P V``).
    ``ACCUMULATE`` False: ``acc = A B``.  ``"e4m3"``: k-blocks of 32 bytes, ``B`` K-major
    (``V^T`` for ``P V``), ``a`` packed by ``make_a_pack(K, "e4m3", ...)``."""
    SS = A_LAYOUT is not None
    TRANS_B = 1 if B_MAJOR == "MN" else 0
    K_STEPS = (B_LAYOUT.COLS if B_MAJOR == "K" else B_LAYOUT.ROWS) // 16
    mma = make_wgmma(N, DTYPE, "smem" if SS else "regs", 0, TRANS_B)
    to_tuple, from_tuple = make_fragment_view(N)
    zeros = make_acc_zeros(N)
    _a_pack, a_words = make_a_pack(K_STEPS, DTYPE)
    # k-block kk's descriptor: the tile's low word plus its start >> 4 (the start field, bits
    # 0-13: a shared address and its tile offsets stay below 2**18, so the 32-bit add never
    # carries out of it), the high word a constant
    B_STEP = tuple(np.uint32(B_LAYOUT.descriptor(B_MAJOR, kk).start >> 4)
                   for kk in range(K_STEPS))
    B_HI = B_LAYOUT.desc_hi(B_MAJOR)
    A_STEP = tuple(np.uint32(A_LAYOUT.descriptor("K", kk).start >> 4)
                   for kk in range(K_STEPS)) if SS else B_STEP
    A_HI = A_LAYOUT.desc_hi("K") if SS else B_HI

    def k_step(kk, ctx, d):
        """k-block ``kk``: one ``mma`` (``scale_d = kk`` without ``ACCUMULATE``: the first
        k-step writes ``D = A B``)."""
        smem, ra, a_lo, b_lo = ctx
        db = desc_at(b_lo, B_STEP[kk], B_HI)
        if SS:
            return mma(smem, desc_at(a_lo, A_STEP[kk], A_HI), db, d, 1 if ACCUMULATE else kk)
        return mma(smem, (ra[4 * kk], ra[4 * kk + 1], ra[4 * kk + 2], ra[4 * kk + 3]), db, d,
                   1 if ACCUMULATE else kk)

    k_steps = static_fold(K_STEPS, k_step)   # unrolled: the tuples read by constant indices

    @_device
    def operands(acc, a):
        d = fence_operand(to_tuple(acc) if ACCUMULATE else zeros())
        return d, (fence_operand(a_words(a)) if not SS else None)

    @_device
    def issue(d, ra, smem, a_addr, b_addr):
        b_lo = desc_lo(b_addr, B_HI)
        a_lo = desc_lo(a_addr, A_HI)
        wgmma_fence()  # the accumulator's and A's registers (written before) before any mma
        d = k_steps((smem, ra, a_lo, b_lo), d)
        wgmma_commit_group()
        return d

    @_device
    def complete(d, acc):
        from_tuple(fence_operand(d), acc)  # after the wait: back into the fragment view

    return operands, issue, complete
# [/docs:warpgroup-gemm]


@functools.lru_cache(maxsize=None)
def make_tile_scan(LAYOUT, THREADS, DTYPE="float16"):
    """``zero_nonfinite(smem, tile_byte, rows, tid)``: the chunks :func:`make_tile_copy` gave
    thread ``tid`` in the tile's first ``rows`` rows, every inf / NaN element set to +0; True
    if there was one (:func:`numba_flash.kernels.ptx.stages.make_tile_scan` in the swizzled
    layout).  The thread then fences its stores for ``wgmma`` (:func:`fence_proxy_async`)
    before the barrier."""
    ROWS, CHUNKS, W = LAYOUT.check().ROWS, LAYOUT.COLS // 8, LAYOUT.W
    TOTAL = ROWS * CHUNKS
    COPIES = -(-TOTAL // THREADS)
    EXACT = TOTAL % THREADS == 0
    zero_word = make_zero_nonfinite_word(DTYPE)

    @_device
    def zero_nonfinite(smem, tile_byte, rows, tid):
        bad = False
        for i in range(COPIES):
            idx = tid + i * THREADS
            if (EXACT or idx < TOTAL) and idx // CHUNKS < rows:
                at = (tile_byte + chunk_offset_device(idx // CHUNKS, idx % CHUNKS, ROWS, W)) >> 2
                for e in range(4):
                    x = smem[at + e]
                    y = zero_word(x)
                    if y != x:
                        smem[at + e] = y
                        bad = True
        return bad

    return zero_nonfinite


# ------------------------------------------------------------------------------------------
# probe kernels: one warpgroup end to end (tests, compile tier, docs)
# ------------------------------------------------------------------------------------------
def _round_up(x, m):
    return -(-x // m) * m


@_device
def tiles_ready():
    """After a thread's :func:`make_tile_copy` calls: commit and wait for its copies, fence them
    for the async proxy, then the barrier; from here every thread's tiles can feed a
    ``wgmma``."""
    cp_async_commit()
    cp_async_wait_all()
    fence_proxy_async()  # this thread's copies (generic proxy) before wgmma reads (async proxy)
    cuda.syncthreads()   # every thread's chunks have landed before the warpgroup reads them


@_device
def load_a_reg(a, tid, kk, reg):
    """A register ``reg`` (0..3) of k-block ``kk`` of thread ``tid`` from the 16-bit bits
    ``a [64 WARPGROUPS, K]`` in global memory (:func:`a_coords`; warpgroup ``tid >> 7`` takes
    rows ``64 (tid >> 7) ..``)."""
    row, col = acc_coords_device(tid & 127, 2 * reg)
    row += 64 * (tid >> 7)
    return half2_bits(a[row, 16 * kk + col], a[row, 16 * kk + col + 1])


@_device
def load_a_reg8(a, tid, kk, reg):
    """A register ``reg`` (0..3) of k-block ``kk`` (32 bytes) of thread ``tid`` from e4m3 bytes
    ``a`` (viewed as byte pairs ``[64 WARPGROUPS, K / 2]``, :func:`a8_tables`: four consecutive
    bytes of row ``16 w + g + 8 (reg & 1)`` from column ``4 t + 16 (reg >> 1)``)."""
    r = tid & 127
    row = 16 * (r >> 5) + ((r & 31) >> 2) + 8 * (reg & 1) + 64 * (tid >> 7)
    col = 32 * kk + 4 * (r & 3) + 16 * (reg >> 1)
    return half2_bits(a[row, col >> 1], a[row, (col >> 1) + 1])


def _store_acc(NH):
    """``store(out, acc, tid, add)``: ``out[row, col] = acc[i] (+ add[row, col])`` by the
    fragment layout, warpgroup ``tid >> 7`` on rows ``64 (tid >> 7) ..`` (``add`` None: plain
    store)."""

    @_device
    def store(out, acc, tid, add):
        for i in range(NH):
            row, col = acc_coords_device(tid & 127, i)
            row += 64 * (tid >> 7)
            if add is None:
                out[row, col] = acc[i]
            else:
                out[row, col] = acc[i] + add[row, col]

    return store


@functools.lru_cache(maxsize=None)
def wgmma_gemm_kernel(N, K, DTYPE="float16", SWIZZLE=128, A_SRC="smem", B_MAJOR="K",
                      WARPGROUPS=1):
    """``kernel(a, b, c, d)`` on ``WARPGROUPS`` warpgroups (``block = 128 WARPGROUPS``; ``M = 64
    WARPGROUPS``): ``d = a @ B + c`` for 16-bit bits ``a [M, K]`` and float32 ``c``, ``d [M, N]``
    (warpgroup ``w`` computes rows ``64 w ..``, its ``A`` 64 rows into the shared tile), with
    ``B [K, N]``, shared by the warpgroups, given as ``b [N, K]``
    (``B_MAJOR="K"``: a row per column of ``B``, as ``K`` rows are) or as ``b [K, N]``
    (``"MN"``, as ``V`` is).  ``a`` and ``b`` go to shared memory by :func:`make_tile_copy`
    (``cp.async``) in :class:`TileLayout` tiles of ``SWIZZLE``; ``K / 16`` ``wgmma`` steps (``A``
    by descriptor, or with ``A_SRC="regs"`` from registers loaded from ``a``) accumulate, one
    commit and wait, then each thread stores its accumulators by :func:`acc_coords`.

    ``DTYPE="e4m3"``: ``a``, ``b`` e4m3 bytes viewed as byte pairs (``uint16 [M, K / 2]``,
    ``[N, K / 2]``; ``B_MAJOR="K"`` only), ``K / 32`` ``m64nNk32`` steps, ``A`` registers by
    :func:`a8_tables`."""
    mma = make_wgmma(N, DTYPE, A_SRC, 0, 1 if B_MAJOR == "MN" else 0)
    zeros = make_acc_zeros(N)
    E8 = DTYPE == "e4m3"
    KSTEP = 32 if E8 else 16            # elements of a k-step (32 bytes or 16 halves)
    if K % KSTEP or K <= 0:
        raise ValueError(f"K: expected a positive multiple of {KSTEP}, got {K}")
    KU = K // 2 if E8 else K            # 16-bit units of a row of K elements
    M, THREADS = 64 * WARPGROUPS, WARPGROUP * WARPGROUPS
    A_LAY = TileLayout(M, KU, SWIZZLE).check()
    B_LAY = (TileLayout(N, KU, SWIZZLE) if B_MAJOR == "K" else TileLayout(K, N, SWIZZLE)).check()
    B_ROWS, B_COLS = B_LAY.ROWS, B_LAY.COLS
    B_OFF = _round_up(A_LAY.BYTES, ARENA_ALIGN)
    WORDS = (B_OFF + _round_up(B_LAY.BYTES, ARENA_ALIGN) + ARENA_ALIGN) // 4  # + align slack
    A_START = tuple(A_LAY.descriptor("K", kk).start for kk in range(K // KSTEP))
    B_START = tuple(B_LAY.descriptor(B_MAJOR, kk).start for kk in range(K // KSTEP))
    A_WG = A_LAY.descriptor("K", 0, mn0=64).start - A_START[0] if WARPGROUPS > 1 else 0
    A_HI, B_HI = A_LAY.desc_hi("K"), B_LAY.desc_hi(B_MAJOR)
    copy_a = make_tile_copy(A_LAY, THREADS)
    copy_b = make_tile_copy(B_LAY, THREADS)
    store = _store_acc(N // 2)
    REGS = A_SRC == "regs"

    @kernel_jit
    def wgmma_gemm(a, b, c, d):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(WORDS, types.uint32)
        pad = align_pad(smem)  # the tiles start on a 1024-byte boundary (the swizzle's pattern)
        if not REGS:
            copy_a(smem, pad, a, 0, KU, M, KU, tid)
        copy_b(smem, pad + B_OFF, b, 0, B_COLS, B_ROWS, B_COLS, tid)
        tiles_ready()
        base = smem_address(smem) + pad
        a_base = base + (tid >> 7) * A_WG  # this warpgroup's 64 rows of the A tile
        acc = fence_operand(zeros())
        wgmma_fence()
        for kk in range(K // KSTEP):
            db = make_desc(base + B_OFF + B_START[kk], B_HI)
            if REGS and E8:  # e4m3: four bytes a register
                ra = fence_operand((load_a_reg8(a, tid, kk, 0), load_a_reg8(a, tid, kk, 1),
                                    load_a_reg8(a, tid, kk, 2), load_a_reg8(a, tid, kk, 3)))
                wgmma_fence()
                acc = mma(smem, ra, db, acc, kk)
            elif REGS:  # this thread's A registers of k-block kk, then the fence that orders them
                ra = fence_operand((load_a_reg(a, tid, kk, 0), load_a_reg(a, tid, kk, 1),
                                    load_a_reg(a, tid, kk, 2), load_a_reg(a, tid, kk, 3)))
                wgmma_fence()
                acc = mma(smem, ra, db, acc, kk)  # scale_d = kk: D = A B on the first step
            else:
                acc = mma(smem, make_desc(a_base + A_START[kk], A_HI), db, acc, kk)
        wgmma_commit_group()
        wgmma_wait_group(0)
        acc = fence_operand(acc)  # complete: the accumulators may be read
        store(d, acc, tid, c)

    return wgmma_gemm


@functools.lru_cache(maxsize=None)
def wgmma_chain_kernel(N1, K, N2, DTYPE="float16", SWIZZLE=128):
    """``kernel(q, k, v, s, o)`` on one warpgroup: the attention shape without its softmax.
    ``s = q @ k.T`` (float32 ``[64, N1]``; 16-bit bits ``q [64, K]``, ``k [N1, K]``: SS, both
    K-major) and ``o = p @ v`` with ``p = DTYPE(s)`` taken from the accumulator registers
    (:func:`make_a_from_acc`) and ``v [N1, N2]`` read MN-major (RS).  Two commit groups: ``S``
    waited for with ``wait_group 0``, then ``O``."""
    mma_s = make_wgmma(N1, DTYPE, "smem", 0, 0)
    mma_o = make_wgmma(N2, DTYPE, "regs", 0, 1)
    zeros_s, zeros_o = make_acc_zeros(N1), make_acc_zeros(N2)
    a_from_acc = make_a_from_acc(DTYPE)
    Q_LAY = TileLayout(64, K, SWIZZLE).check()
    K_LAY = TileLayout(N1, K, SWIZZLE).check()
    V_LAY = TileLayout(N1, N2, SWIZZLE).check()
    K_OFF = _round_up(Q_LAY.BYTES, ARENA_ALIGN)
    V_OFF = K_OFF + _round_up(K_LAY.BYTES, ARENA_ALIGN)
    WORDS = (V_OFF + _round_up(V_LAY.BYTES, ARENA_ALIGN) + ARENA_ALIGN) // 4
    Q_START = tuple(Q_LAY.descriptor("K", kk).start for kk in range(K // 16))
    K_START = tuple(K_LAY.descriptor("K", kk).start for kk in range(K // 16))
    V_START = tuple(V_LAY.descriptor("MN", j).start for j in range(N1 // 16))
    Q_HI, K_HI, V_HI = Q_LAY.desc_hi("K"), K_LAY.desc_hi("K"), V_LAY.desc_hi("MN")
    copy_q = make_tile_copy(Q_LAY, WARPGROUP)
    copy_k = make_tile_copy(K_LAY, WARPGROUP)
    copy_v = make_tile_copy(V_LAY, WARPGROUP)
    store_s, store_o = _store_acc(N1 // 2), _store_acc(N2 // 2)

    # [docs:wgmma-chain]
    @kernel_jit
    def wgmma_chain(q, k, v, s, o):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(WORDS, types.uint32)
        pad = align_pad(smem)
        copy_q(smem, pad, q, 0, K, 64, K, tid)
        copy_k(smem, pad + K_OFF, k, 0, K, N1, K, tid)
        copy_v(smem, pad + V_OFF, v, 0, N2, N1, N2, tid)
        tiles_ready()  # the copies landed, fenced for wgmma, visible to every thread
        base = smem_address(smem) + pad
        acc_s = fence_operand(zeros_s())
        wgmma_fence()
        for kk in range(K // 16):  # S = Q K^T: SS, both K-major
            acc_s = mma_s(smem, make_desc(base + Q_START[kk], Q_HI),
                          make_desc(base + K_OFF + K_START[kk], K_HI), acc_s, kk)
        wgmma_commit_group()
        wgmma_wait_group(0)
        acc_s = fence_operand(acc_s)
        acc_o = fence_operand(zeros_o())
        for j in range(N1 // 16):  # O = P V: P from the S registers (RS), V MN-major
            p = fence_operand(a_from_acc(acc_s, j))
            wgmma_fence()  # P's registers (just written) and O's before the mma reads them
            acc_o = mma_o(smem, p, make_desc(base + V_OFF + V_START[j], V_HI), acc_o, j)
        wgmma_commit_group()
        wgmma_wait_group(0)
        acc_o = fence_operand(acc_o)
        store_s(s, acc_s, tid, None)
        store_o(o, acc_o, tid, None)
    # [/docs:wgmma-chain]

    return wgmma_chain


def flop(N):
    """Floating-point operations of one ``m64nNk16`` (the whole warpgroup's instruction; each
    of its 4 warps issues it, so per warp-issued ``HGMMA`` a quarter of this)."""
    return 2 * 64 * N * 16


__all__ = ["WARPGROUP", "WGMMA_N", "SWIZZLES", "MAJORS", "CC", "Descriptor", "TileLayout",
           "acc_coords", "a_coords", "acc_tables", "acc_fragments", "matrix_from_acc",
           "a_fragments", "desc_bits", "encode_descriptor", "decode_descriptor",
           "swizzle_address", "canonical_offsets", "operand_addresses", "chunk_offset",
           "make_wgmma", "make_acc_zeros", "make_a_from_acc", "make_tile_copy", "make_desc",
           "make_fragment_view", "make_a_pack", "make_warpgroup_gemm",
           "make_tile_scan", "a8_tables", "WGMMA_DTYPES",
           "tiles_ready", "align_pad", "desc_pack", "warp_uniform", "wgmma_fence",
           "wgmma_commit_group", "wgmma_wait_group",
           "fence_operand", "fence_proxy_async", "smem_address", "wgmma_gemm_kernel",
           "wgmma_chain_kernel", "flop"]
