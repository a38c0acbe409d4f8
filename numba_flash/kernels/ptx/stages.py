"""Tile stages for the tensor-core and SIMT kernels: 16-byte async copies, ``ldmatrix``, ``ex2``.

Each stage is a device function the kernels call by name.  On the GPU it is an ``@intrinsic``
emitting one PTX instruction (a plain LLVM load for :func:`load_u16`); in the simulator, which
cannot run inline PTX, a *twin* of the same semantics, written from the PTX ISA's definition (the
tests check every twin against it).  Shared memory is addressed in **bytes** from the start of a
shared array ``smem`` (``smem_byte``), global memory in **elements** from the start of a
C-contiguous array of any shape (``elem``).

Copies (global -> shared, 16 bytes per instruction):

* :func:`cp_async16` ``(smem, smem_byte, src, elem, src_bytes)``: ``cp.async.cg.shared.global``
  of ``src_bytes`` (0 or 16) bytes, the rest of the 16 zero-filled, both addresses 16-byte
  aligned; :func:`cp_async_commit`, :func:`cp_async_wait_all` (``wait_group 0``),
  :func:`cp_async_wait_one` (``1``), :func:`cp_async_wait` ``(N)`` (compile-time ``N`` <=
  :data:`CP_ASYNC_MAX_PENDING`); a ``cuda.syncthreads()`` after the wait publishes the data;
  :func:`cp_async16_rows` ``(smem, smem_byte, src, elem, row_stride, rows, cols)``: 16 bytes
  from ``elem + rows row_stride + cols``, the row offset one ``mad.wide.s32`` (a strided
  view's rows: a run-time stride);
* :func:`make_tile_copy` -> ``copy_tile(smem, smem_byte, src, elem_base, rows_valid, d, tid)``,
  :func:`make_pair_load`, :func:`make_tile_scan` -> ``zero_nonfinite(smem, smem_byte, rows,
  tid)``, :func:`make_zero_nonfinite_word`.

Fragments (shared -> registers): :func:`ldmatrix_x4`, :func:`ldmatrix_x4_trans` ``(smem,
smem_byte)`` -> 4 ``uint32`` (``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``: an ``A``
fragment of :mod:`numba_flash.kernels.ptx.mma`, or the ``B`` fragments of 16 columns);
:func:`ldmatrix_rows` (where each lane points); rows of :func:`row_bytes` ``= 2 HEAD_DIM + 16``.

Single instructions: :func:`ex2` ``(x)`` (``ex2.approx.ftz.f32``), :func:`fmax` (``max.f32``),
:func:`fma` (``fma.rn.f32``), :func:`shfl_xor` ``(x, lane_mask)`` (``shfl.sync.bfly``),
:func:`warp_any` ``(pred)`` (``vote.sync.any``), :func:`load_u16`, :func:`load_at` ``(src, elem)``
(one element), :func:`load16` ``(src, elem)`` (``ld.global.nc.v4.u32``: 16 bytes of a float16,
float32 or float64 array as a tuple in the compute type), :func:`red_add` ``(dst, elem, val)``
(``red.global.add.f32``), :func:`in_loop` ``(x)`` (a volatile ``mov``: not hoisted out of the
caller's loop), :func:`wide_mad` ``(a, b, c)`` (``mad.wide.s32``: ``a b + c`` in 64 bits from
int32 ``a``, ``b``), :func:`lds16` ``(smem, smem_byte)`` (``ld.shared.v4.f32`` /
``.v2.f64``).  For the SIMT kernels: :func:`make_exp_e`, :func:`make_row_dot`.

Alignment: every twin checks the real byte address against its instruction's rule (16 for
``cp.async``, ``ldmatrix``, ``load16``, ``lds16``; 4 for ``red_add``; the element's size for
``load_u16``, ``load_at``) and raises
:class:`~numba_flash.kernels.ptx.address.MisalignedAddressError` where a GPU faults
(:mod:`~numba_flash.kernels.ptx.address`: global addresses are the arrays' own pointers, shared
ones the offset in the allocation from a 16-byte aligned base).

File: the host helpers, the GPU intrinsics, the twins, the stage factories, and the probe kernels
the compile tier builds for sm_80 and sm_90 (the catalog's ``stages_configs``,
``tools/catalog/ptx.py``).  Every stage's semantics, twin and reason:
docs/tensor-cores.md#the-stages-instruction-by-instruction.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import namedtuple
from types import SimpleNamespace

import numpy as np
from numba import cuda, int32, types, uint32

from ...backend import on_simulator
from ..core.jit import device_jit, kernel_jit
from . import address, record
from .mma import WARP
from ..core.config import mma_row_bytes

#: the PTX instructions behind the intrinsics
LDMATRIX_PTX = "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
LDMATRIX_T_PTX = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"
CP_ASYNC_PTX = "cp.async.cg.shared.global"
LOAD16_PTX = "ld.global.nc.v4.u32"
RED_ADD_PTX = "red.global.add.f32"
#: the most cp.async groups a kernel leaves in flight (:func:`cp_async_wait`)
CP_ASYNC_MAX_PENDING = 6

#: the alignment of a shared array read or written 16 bytes at a time (``cp.async``,
#: ``ldmatrix``, :func:`lds16`): 16, or None in the simulator (no ``alignment`` argument there:
#: its twins take a shared allocation to start 16-byte aligned, ``address.SHARED_BASE``).
#: Without it NVVM declares ``.align 4`` and the linker may place the array at 8 mod 16.
SHARED_ALIGN = None if on_simulator() else 16
#: element types :func:`load16` reads
LOAD16_TYPES = (types.float16, types.float32, types.float64)

LOG2E = math.log2(math.e)

_EXP16 = 0x7C00  # float16 exponent bits: all set = inf or NaN

#: exponent bits of a 16-bit element type: all set = inf or NaN (e4m3fn: exponent and mantissa
#: bits all set = NaN, its only non-finite value)
EXP_BITS = {"float16": 0x7C00, "bfloat16": 0x7F80, "e4m3": 0x7F}


def row_bytes(head_dim):
    """Bytes of one padded shared row of ``head_dim`` float16 (+16: no bank conflicts)."""
    return 2 * head_dim + 16


def ldmatrix_rows(lane, kind):
    """``(row, col)`` offsets (in rows and halves) of the 8 x 8 block whose row ``lane`` points
    at, for one ``x4`` covering a 16 x 16 block of a row-major tile:

    * ``"a"``: an ``A`` fragment (rows = ``M``, columns = ``K``): matrices (rows 0-7, cols 0-7),
      (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) -> registers ``a0, a1, a2, a3``;
    * ``"b"``: ``B`` of ``Q K^T`` from a tile of keys (rows = keys ``n``, columns = ``k``):
      (0-7, 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15) -> ``b0, b1`` of keys 0-7, then of 8-15;
    * ``"bt"``: ``B`` of ``P V`` from a row-major ``V`` tile with ``.trans`` (rows = keys ``k``,
      columns = ``n``): (0-7, 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) -> ``b0, b1`` of
      columns 0-7, then of 8-15.
    """
    m, r = lane >> 3, lane & 7
    if kind == "a" or kind == "bt":
        return r + 8 * (m & 1), 8 * (m >> 1)
    if kind == "b":
        return r + 8 * (m >> 1), 8 * (m & 1)
    raise ValueError(f"kind: expected 'a', 'b' or 'bt', got {kind!r}")


# ------------------------------------------------------------------------------------------
# GPU implementations: inline PTX and LLVM intrinsics
# ------------------------------------------------------------------------------------------
def gpu_helpers():
    """The LLVM and numba-cuda pieces the GPU stages are written with (imported on first use:
    a simulator run never loads them): ``ir``, ``intrinsic``, the typing error, the LLVM int and
    float types, argument checks and the shared / global address of an array element."""
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    try:
        from numba.cuda.core.errors import NumbaTypeError
    except ImportError:  # pragma: no cover - other numba-cuda versions
        from numba.core.errors import NumbaTypeError

    i32 = ir.IntType(32)
    i64 = ir.IntType(64)
    f32 = ir.FloatType()

    def check_int(name, what, ty):
        if not isinstance(ty, types.Integer):
            raise NumbaTypeError(f"{name}: expected {what} as an integer, got {ty}")

    def check_array(name, what, ty, dtype):
        if not isinstance(ty, types.Array) or ty.dtype != dtype:
            raise NumbaTypeError(f"{name}: expected {what} as a {dtype} array, got {ty}")

    def as_i(context, builder, ty, val, bits):
        """An integer argument as an LLVM i32 / i64 (truncated or sign-extended)."""
        return context.cast(builder, val, ty, types.int32 if bits == 32 else types.int64)

    def smem_addr(context, builder, aryty, ary, ty, byte):
        """The 32-bit shared-window address of byte ``byte`` of the shared array ``ary``."""
        data = context.make_array(aryty)(context, builder, ary).data
        shared = builder.addrspacecast(data, ir.PointerType(data.type.pointee, 3))
        return builder.add(builder.ptrtoint(shared, i32), as_i(context, builder, ty, byte, 32))

    def global_addr(context, builder, aryty, ary, ty, elem):
        """The 64-bit generic address of element ``elem`` of the flat view of ``ary``."""
        data = context.make_array(aryty)(context, builder, ary).data
        ptr = builder.gep(data, [as_i(context, builder, ty, elem, 64)])
        return builder.ptrtoint(ptr, i64)

    return SimpleNamespace(ir=ir, intrinsic=intrinsic, NumbaTypeError=NumbaTypeError, i32=i32,
                           i64=i64, f32=f32, check_int=check_int, check_array=check_array,
                           as_i=as_i, smem_addr=smem_addr, global_addr=global_addr)


def _gpu_memory_stages(h):
    """The copies and loads (``ldmatrix``, ``cp.async``, ``red.add``, 16-byte global and shared
    loads) as inline PTX, from :func:`gpu_helpers`'s pieces ``h``."""
    ir, intrinsic, NumbaTypeError = h.ir, h.intrinsic, h.NumbaTypeError
    i32, i64, f32 = h.i32, h.i64, h.f32
    check_int, check_array, as_i = h.check_int, h.check_array, h.as_i
    smem_addr, global_addr = h.smem_addr, h.global_addr

    # [docs:ldmatrix-intrinsic]
    def make_ldmatrix(ptx, name):
        @intrinsic
        def ldmatrix(typingctx, smem, smem_byte):
            check_array(name, "smem", smem, types.uint32)
            check_int(name, "smem_byte", smem_byte)
            sig = types.UniTuple(types.uint32, 4)(smem, smem_byte)

            def codegen(context, builder, sig, args):
                addr = smem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
                fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32])
                asm = ir.InlineAsm(fnty, ptx + " {$0, $1, $2, $3}, [$4];",
                                   "=r,=r,=r,=r,r,~{memory}", side_effect=True)
                res = builder.call(asm, [addr])
                outs = [builder.extract_value(res, i) for i in range(4)]
                return context.make_tuple(builder, sig.return_type, outs)

            return sig, codegen

        return ldmatrix
    # [/docs:ldmatrix-intrinsic]

    @intrinsic
    def cp_async16(typingctx, smem, smem_byte, src, elem, src_bytes):
        """Copy 16 bytes (``src_bytes`` of them read, the rest zero) global -> shared."""
        for what, ty in (("smem", smem), ("src", src)):
            if not isinstance(ty, types.Array):
                raise NumbaTypeError(f"cp_async16: expected {what} as an array, got {ty}")
        for what, ty in (("smem_byte", smem_byte), ("elem", elem), ("src_bytes", src_bytes)):
            check_int("cp_async16", what, ty)
        sig = types.none(smem, smem_byte, src, elem, src_bytes)

        def codegen(context, builder, sig, args):
            dst = smem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            gsrc = global_addr(context, builder, sig.args[2], args[2], sig.args[3], args[3])
            nbytes = as_i(context, builder, sig.args[4], args[4], 32)
            fnty = ir.FunctionType(ir.VoidType(), [i32, i64, i32])
            asm = ir.InlineAsm(fnty, CP_ASYNC_PTX + " [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                               side_effect=True)
            builder.call(asm, [dst, gsrc, nbytes])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async16_rows(typingctx, smem, smem_byte, src, elem, row_stride, rows, cols):
        """:func:`cp_async16` of 16 bytes from element ``elem + rows * row_stride + cols`` of
        ``src`` (``row_stride``, ``rows``, ``cols``: int32), its address one ``mad.wide.s32``
        from ``elem``'s: with ``rows`` and ``cols`` constants, a strided tile's row costs one
        ``IMAD.WIDE`` (not a 64-bit multiply and add) and its chunks along the row none (the
        instruction's immediate offset)."""
        for what, ty in (("smem", smem), ("src", src)):
            if not isinstance(ty, types.Array):
                raise NumbaTypeError(f"cp_async16_rows: expected {what} as an array, got {ty}")
        for what, ty in (("smem_byte", smem_byte), ("elem", elem), ("row_stride", row_stride),
                         ("rows", rows), ("cols", cols)):
            check_int("cp_async16_rows", what, ty)
        sig = types.none(smem, smem_byte, src, elem, row_stride, rows, cols)

        def codegen(context, builder, sig, args):
            dst = smem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            gsrc = global_addr(context, builder, sig.args[2], args[2], sig.args[3], args[3])
            stride = as_i(context, builder, sig.args[4], args[4], 32)
            size = context.get_abi_sizeof(context.get_data_type(sig.args[2].dtype))
            step = builder.mul(as_i(context, builder, sig.args[5], args[5], 32),
                               ir.Constant(i32, size))
            mad = ir.InlineAsm(ir.FunctionType(i64, [i32, i32, i64]),
                               "mad.wide.s32 $0, $1, $2, $3;", "=l,r,r,l")
            addr = builder.add(builder.call(mad, [stride, step, gsrc]), builder.sext(
                builder.mul(as_i(context, builder, sig.args[6], args[6], 32),
                            ir.Constant(i32, size)), i64))
            fnty = ir.FunctionType(ir.VoidType(), [i32, i64])
            asm = ir.InlineAsm(fnty, CP_ASYNC_PTX + " [$0], [$1], 16, 16;", "r,l,~{memory}",
                               side_effect=True)
            builder.call(asm, [dst, addr])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def red_add(typingctx, dst, elem, val):
        """``dst[elem] += val`` (float32, flat element ``elem``): one ``red.global.add.f32``."""
        check_array("red_add", "dst", dst, types.float32)
        check_int("red_add", "elem", elem)
        if val != types.float32:
            raise NumbaTypeError(f"red_add: expected val as a float32, got {val}")
        sig = types.none(dst, elem, val)

        def codegen(context, builder, sig, args):
            addr = global_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            fnty = ir.FunctionType(ir.VoidType(), [i64, f32])
            asm = ir.InlineAsm(fnty, RED_ADD_PTX + " [$0], $1;", "l,f,~{memory}",
                               side_effect=True)
            builder.call(asm, [addr, args[2]])
            return context.get_dummy_value()

        return sig, codegen

    def flat_load(context, builder, sig, args):
        """One plain load of element ``args[1]`` of the flat view of array ``args[0]``."""
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.load(builder.gep(data, [as_i(context, builder, sig.args[1], args[1], 64)]))

    @intrinsic
    def load_u16(typingctx, src, elem):
        """``src`` (uint16, any shape) at flat element ``elem``."""
        check_array("load_u16", "src", src, types.uint16)
        check_int("load_u16", "elem", elem)
        return types.uint16(src, elem), flat_load


    @intrinsic
    def load_at(typingctx, src, elem):
        """``src`` (any dtype, any shape) at flat element ``elem``: one plain load."""
        if not isinstance(src, types.Array):
            raise NumbaTypeError(f"load_at: expected src as an array, got {src}")
        check_int("load_at", "elem", elem)
        return src.dtype(src, elem), flat_load

    @intrinsic
    def store_at(typingctx, dst, elem, val):
        """``dst`` (any dtype, any shape or strides) at flat element ``elem`` (counted in
        memory from its first element, as :func:`load_at`) takes ``val``: one plain store (a
        strided output's epilogue, where ``dst[i]`` would need a 1-D C array)."""
        if not isinstance(dst, types.Array):
            raise NumbaTypeError(f"store_at: expected dst as an array, got {dst}")
        check_int("store_at", "elem", elem)
        sig = types.none(dst, elem, val)

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            value = context.cast(builder, args[2], sig.args[2], sig.args[0].dtype)
            builder.store(value, builder.gep(
                data, [as_i(context, builder, sig.args[1], args[1], 64)]))
            return context.get_dummy_value()

        return sig, codegen

    # [docs:load16-intrinsic]
    @intrinsic
    def load16(typingctx, src, elem):
        """16 bytes of ``src`` (float16/32/64, any shape) from flat element ``elem``, as a
        tuple of ``16 / itemsize`` values in the compute type (float16 -> float32)."""
        if not isinstance(src, types.Array) or src.dtype not in LOAD16_TYPES:
            raise NumbaTypeError(f"load16: expected src as a float16, float32 or float64 array, "
                                 f"got {src}")
        check_int("load16", "elem", elem)
        n = 128 // src.dtype.bitwidth
        out_t = types.float64 if src.dtype == types.float64 else types.float32
        sig = types.UniTuple(out_t, n)(src, elem)

        def codegen(context, builder, sig, args):
            gaddr = global_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i64])
            # read-only and no side effect: the compiler may schedule it early (loads in flight)
            asm = ir.InlineAsm(fnty, "{ .reg .u64 g; cvta.to.global.u64 g, $4; "
                               + LOAD16_PTX + " {$0, $1, $2, $3}, [g]; }",
                               "=r,=r,=r,=r,l")
            res = builder.call(asm, [gaddr])
            vec = ir.Constant(ir.VectorType(i32, 4), ir.Undefined)
            for i in range(4):
                vec = builder.insert_element(vec, builder.extract_value(res, i),
                                             ir.Constant(i32, i))
            elem_ty = {types.float16: ir.HalfType(), types.float32: f32,
                       types.float64: ir.DoubleType()}[sig.args[0].dtype]  # (Numba's f16: i16)
            vals = builder.bitcast(vec, ir.VectorType(elem_ty, n))
            if sig.args[0].dtype == types.float16:
                vals = builder.fpext(vals, ir.VectorType(f32, n))
            outs = [builder.extract_element(vals, ir.Constant(i32, i)) for i in range(n)]
            return context.make_tuple(builder, sig.return_type, outs)

        return sig, codegen
    # [/docs:load16-intrinsic]

    @intrinsic
    def lds16(typingctx, smem, smem_byte):
        """16 bytes of the float32 / float64 shared array ``smem`` from byte ``smem_byte``."""
        if not isinstance(smem, types.Array) or smem.dtype not in (types.float32,
                                                                  types.float64):
            raise NumbaTypeError(f"lds16: expected smem as a float32 or float64 shared array, "
                                 f"got {smem}")
        check_int("lds16", "smem_byte", smem_byte)
        wide = smem.dtype == types.float64
        n = 2 if wide else 4
        sig = types.UniTuple(smem.dtype, n)(smem, smem_byte)

        def codegen(context, builder, sig, args):
            addr = smem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            ty = ir.DoubleType() if wide else f32
            regs = ", ".join(f"${i}" for i in range(n))
            ptx = f"ld.shared.v{n}.{'f64' if wide else 'f32'} {{{regs}}}, [${n}];"
            cons = ",".join(["=d" if wide else "=f"] * n) + ",r,~{memory}"
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([ty] * n), [i32]), ptx,
                               cons, side_effect=True)
            res = builder.call(asm, [addr])
            outs = [builder.extract_value(res, i) for i in range(n)]
            return context.make_tuple(builder, sig.return_type, outs)

        return sig, codegen

    return dict(
        load16=load16,
        lds16=lds16,
        ldmatrix_x4=make_ldmatrix(LDMATRIX_PTX, "ldmatrix_x4"),
        ldmatrix_x4_trans=make_ldmatrix(LDMATRIX_T_PTX, "ldmatrix_x4_trans"),
        cp_async16=cp_async16,
        cp_async16_rows=cp_async16_rows,
        load_u16=load_u16,
        load_at=load_at,
        store_at=store_at,
        red_add=red_add,
    )


def _gpu_math_stages(h):
    """The arithmetic and ordering stages (``ex2``, ``max``, ``fma``, ``in_loop``, the
    ``cp.async`` commit and waits) as inline PTX or LLVM intrinsics, from
    :func:`gpu_helpers`'s pieces ``h``."""
    ir, intrinsic, NumbaTypeError = h.ir, h.intrinsic, h.NumbaTypeError
    i32, f32 = h.i32, h.f32

    @intrinsic
    def in_loop(typingctx, x):
        if x != types.int32:
            raise NumbaTypeError(f"in_loop: expected x as an int32, got {x}")
        sig = types.int32(x)

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32]), "mov.b32 $0, $1;", "=r,r",
                               side_effect=True)
            return builder.call(asm, [args[0]])

        return sig, codegen

    @intrinsic
    def wide_mad(typingctx, a, b, c):
        """``a * b + c`` in 64 bits, ``a`` and ``b`` taken as int32: one ``mad.wide.s32``
        (``IMAD.WIDE``), where Numba's int64 product of two widened int32 values can reach
        ptxas as a full 64-bit multiply (three ``IMAD``) and an add."""
        for what, ty in (("a", a), ("b", b), ("c", c)):
            h.check_int("wide_mad", what, ty)
        sig = types.int64(a, b, c)

        def codegen(context, builder, sig, args):
            x, y = (h.as_i(context, builder, t, v, 32) for t, v in zip(sig.args[:2], args[:2]))
            z = h.as_i(context, builder, sig.args[2], args[2], 64)
            asm = ir.InlineAsm(ir.FunctionType(h.i64, [i32, i32, h.i64]),
                               "mad.wide.s32 $0, $1, $2, $3;", "=l,r,r,l")
            return builder.call(asm, [x, y, z])

        return sig, codegen

    def make_bare(ptx):
        @intrinsic
        def bare(typingctx):
            sig = types.none()

            def codegen(context, builder, sig, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), ptx, "~{memory}",
                                   side_effect=True)
                builder.call(asm, [])
                return context.get_dummy_value()

            return sig, codegen

        return bare

    def float_sig(name, args):
        if any(a != types.float32 for a in args):
            raise NumbaTypeError(f"{name}: expected float32 arguments, got {args}")
        return types.float32(*args)

    def float_asm(ptx, n):
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(f32, [f32] * n), ptx, "=f" + ",f" * n)
            return builder.call(asm, list(args))

        return codegen

    def ex2_codegen(context, builder, sig, args):
        fn = builder.module.declare_intrinsic("llvm.nvvm.ex2.approx.ftz.f", (),
                                              ir.FunctionType(f32, [f32]))
        return builder.call(fn, list(args))

    @intrinsic
    def ex2(typingctx, x):
        """``2**x`` by ``ex2.approx.ftz.f32``."""
        return float_sig("ex2", (x,)), ex2_codegen

    @intrinsic
    def fmax(typingctx, a, b):
        """``max.f32``: the larger, the other operand if one is NaN."""
        return float_sig("fmax", (a, b)), float_asm("max.f32 $0, $1, $2;", 2)

    @intrinsic
    def fma(typingctx, a, b, c):
        """``a * b + c`` rounded once."""
        return float_sig("fma", (a, b, c)), float_asm("fma.rn.f32 $0, $1, $2, $3;", 3)

    return dict(
        cp_async_commit=make_bare("cp.async.commit_group;"),
        cp_async_wait_all=make_bare("cp.async.wait_group 0;"),
        cp_async_wait_one=make_bare("cp.async.wait_group 1;"),
        cp_async_wait_group={n: make_bare(f"cp.async.wait_group {n};")
                             for n in range(CP_ASYNC_MAX_PENDING + 1)},
        ex2=ex2,
        fmax=fmax,
        fma=fma,
        in_loop=in_loop,
        wide_mad=wide_mad,
    )


def _gpu_stages():
    """Every GPU stage of this module, by name."""
    h = gpu_helpers()
    return {**_gpu_memory_stages(h), **_gpu_math_stages(h)}


# ------------------------------------------------------------------------------------------
# simulator twins: the PTX ISA's definitions in NumPy
# ------------------------------------------------------------------------------------------
def _host_array(arr):
    """The NumPy array behind a simulator kernel argument (or a plain ndarray)."""
    item = arr.__dict__.get("_item", arr) if hasattr(arr, "__dict__") else arr
    return np.asarray(getattr(item, "_ary", item))


def memory_flat(ary):
    """The 1-D view of the memory the NumPy array ``ary`` spans, from its first element: flat
    element ``e`` of a kernel's array is ``e`` elements past its first one in memory, as the
    GPU's loads address it (a strided view included: element ``(i, j, ..)`` is flat element
    ``i s0 + j s1 + ..``, ``s`` its strides in elements, each >= 0)."""
    size = ary.dtype.itemsize
    if any(s < 0 or s % size for s in ary.strides):
        raise ValueError(f"memory_flat: expected non-negative strides in whole elements, got "
                         f"{ary.strides} ({size}-byte elements)")
    extent = 1 + sum((n - 1) * (s // size) for n, s in zip(ary.shape, ary.strides)) \
        if ary.size else 0
    return np.lib.stride_tricks.as_strided(ary, shape=(extent,), strides=(size,))


_STRIDED = "_numba_flash_strided"   # the cache key in a simulator device array's __dict__


def _is_strided(src):
    """Whether the array behind ``src`` is not C-contiguous, cached on the simulator's device
    array as :func:`~numba_flash.kernels.ptx.address.pointer_and_size` caches its pointer (a
    twin asks at every load: a few dict lookups, not a NumPy call)."""
    d = getattr(src, "__dict__", None)
    if d is None:
        return not np.asarray(src).flags.c_contiguous
    item = d.get("_item")
    fake = d if item is None else item.__dict__
    got = fake.get(_STRIDED)
    if got is None:
        got = fake[_STRIDED] = not _host_array(src).flags.c_contiguous
    return got


def _host_flat(arr):
    """The flat NumPy view of a simulator kernel argument (or of a plain ndarray): its memory
    (:func:`memory_flat`), the C-order view where it is C-contiguous."""
    ary = _host_array(arr)
    return ary.reshape(-1) if ary.flags.c_contiguous else memory_flat(ary)


def _read_flat(src, elem, n):
    """Elements ``elem .. elem + n - 1`` of ``src``'s flat (C-order) view, read through the
    array's own indexing: one slice of its last axis (the chunks the kernels copy never cross a
    row), so a wrapper that counts element accesses (docs/examples/io_count.py) sees exactly
    these elements; a chunk that does cross a row is read from the flat view."""
    e = int(elem)
    if _is_strided(src):   # a strided view: its memory (memory_flat)
        return _host_flat(src)[e:e + n]
    shape = tuple(src.shape)  # (the simulator's FakeShape refuses negative indices)
    idx = np.unravel_index(e, shape)
    if idx[-1] + n <= shape[-1]:
        out = src[tuple(int(i) for i in idx[:-1]) + (slice(int(idx[-1]), int(idx[-1]) + n),)]
        return np.asarray(out).reshape(-1)
    return _host_flat(src)[e:e + n]


def _sim_cp_async16(smem, smem_byte, src, elem, src_bytes):
    """Twin of :func:`cp_async16`: the 16 bytes land at once (zero past ``src_bytes``); any
    element types (the copy moves bytes), ``elem`` counted in ``src``'s elements.  Both
    addresses 16-byte aligned (the source's even when ``src_bytes`` is 0: the ISA's rule for
    the operand), else :class:`~numba_flash.kernels.ptx.address.MisalignedAddressError`."""
    b = int(smem_byte)
    if record.RECORDER is not None:   # recording mode (numba_flash.tools.memory_profile)
        smem, src = record.RECORDER.twin_cp_async(smem, b, src, elem, int(src_bytes))
    address.check_shared(smem, b, 16, "cp_async16", CP_ASYNC_PTX, "the destination smem")
    address.check_global(src, elem, 16, "cp_async16", CP_ASYNC_PTX, "the source src")
    n = int(src_bytes)
    data = np.zeros(16, np.uint8)
    if n:
        size = np.dtype(src.dtype).itemsize
        data[:n] = np.ascontiguousarray(_read_flat(src, elem, n // size)).view(np.uint8)
    dst = smem.reshape(-1)
    size = dst.itemsize
    dst[b // size:(b + 16) // size] = data.view(dst.dtype)


def _sim_cp_async16_rows(smem, smem_byte, src, elem, row_stride, rows, cols):
    """Twin of :func:`cp_async16_rows`: :func:`cp_async16` of 16 bytes from element ``elem +
    rows * row_stride + cols``."""
    _sim_cp_async16(smem, smem_byte, src, int(elem) + int(rows) * int(row_stride) + int(cols),
                    16)


_RED_LOCK = threading.Lock()


def _sim_in_loop(x):
    """Twin of :func:`in_loop`: the value itself (hoisting is a compiler's matter)."""
    return x


def _sim_wide_mad(a, b, c):
    """Twin of :func:`wide_mad`: ``a * b + c`` (int32 ``a``, ``b``; int64 result)."""
    return np.int64(int(np.int32(a)) * int(np.int32(b)) + int(c))


def _sim_red_add(dst, elem, val):
    """Twin of :func:`red_add`: a float32 add into ``dst``'s flat view under a lock (the
    simulator's threads are Python threads)."""
    if np.dtype(dst.dtype) != np.float32:
        raise TypeError(f"red_add: expected dst as a float32 array, got {dst.dtype}")
    if record.RECORDER is not None:
        dst = record.RECORDER.twin_global(dst, elem, 4, "red")
    address.check_global(dst, elem, 4, "red_add", RED_ADD_PTX, "dst")
    flat = _host_flat(dst)
    with _RED_LOCK:
        flat[int(elem)] = np.float32(flat[int(elem)] + np.float32(val))


def _sim_nothing():
    """Twin of ``cp.async.commit_group`` / ``wait_group``: the twin's copies are synchronous."""


# [docs:ldmatrix-twin]
def _sim_ldmatrix(smem, smem_byte, trans):
    """Twin of ``ldmatrix .x4``: every lane reads the 8 halves its address points at, the warp
    exchanges them, and lane ``4 r + w`` takes from matrix ``m`` (rows of lanes ``8m .. 8m+7``)
    halves ``2w, 2w+1`` of row ``r`` or, with ``trans``, half ``r`` of rows ``2w`` and
    ``2w + 1`` (the warp's four registers a lane sorted out once, by one lane)."""
    from ... import simulator_warp

    address.check_shared(smem, smem_byte, 16, "ldmatrix",
                         LDMATRIX_T_PTX if trans else LDMATRIX_PTX, "smem (this lane's row)")
    w = int(smem_byte) >> 2
    row = np.asarray(smem[w:w + 4], np.uint32).view(np.uint16).copy()

    def registers(rows):   # [4 matrices, 32 lanes] uint32: matrix m's pair for lane 4 r + w
        if len(rows) != WARP:
            raise RuntimeError(f"ldmatrix: needs a full warp of 32 lanes, got {len(rows)}")
        mats = np.array(rows, np.uint16).reshape(4, 8, 8)   # [matrix, row, half]
        if trans:   # half r of rows 2w, 2w + 1: the pair (2w, 2w + 1) of the transpose's row r
            mats = mats.transpose(0, 2, 1)
        return np.ascontiguousarray(mats).view(np.uint32).reshape(4, WARP)

    regs = simulator_warp.exchange_once(row, registers)
    lane = simulator_warp.lane_id()
    return tuple(np.uint32(regs[m, lane]) for m in range(4))
# [/docs:ldmatrix-twin]


def _sim_ldmatrix_x4(smem, smem_byte):
    if record.RECORDER is not None:   # recording mode (numba_flash.tools.memory_profile)
        smem = record.RECORDER.twin_shared(smem, smem_byte, 16, "ldsm")
    return _sim_ldmatrix(smem, smem_byte, False)


def _sim_ldmatrix_x4_trans(smem, smem_byte):
    if record.RECORDER is not None:
        smem = record.RECORDER.twin_shared(smem, smem_byte, 16, "ldsm")
    return _sim_ldmatrix(smem, smem_byte, True)


_TINY = np.finfo(np.float32).tiny


def _sim_ex2(x):
    """Twin of ``ex2.approx.ftz.f32``: ``2**x`` in float32, subnormal input and output -> 0
    (the device result is within about 2 ulp of this)."""
    x = np.float32(x)
    if x != 0 and abs(x) < _TINY:
        x = np.float32(0.0)
    with np.errstate(over="ignore", under="ignore"):
        y = np.float32(np.exp2(np.float64(x)))
    return np.float32(0.0) if (y != 0 and abs(y) < _TINY) else y


def _sim_fmax(a, b):
    """Twin of ``max.f32``: the larger of ``a`` and ``b``; the other one if one is NaN."""
    return np.float32(np.fmax(np.float32(a), np.float32(b)))


def _sim_fma(a, b, c):
    """Twin of ``fma.rn.f32`` (the float64 product of two float32 is exact)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _sim_shfl_xor(x, lane_mask):
    """Twin of :func:`shfl_xor`: the warp's lanes exchange ``x`` (every lane must call)."""
    from ... import simulator_warp

    values = simulator_warp.exchange(x)
    src = simulator_warp.lane_id() ^ int(lane_mask)
    return values[src] if src < len(values) else x


def _sim_warp_any(pred):
    """Twin of :func:`warp_any`: True on every lane if ``pred`` holds on any lane of the warp."""
    from ... import simulator_warp

    return any(bool(p) for p in simulator_warp.exchange(bool(pred)))


def _sim_load_u16(src, elem):
    """Twin of :func:`load_u16`: one 2-byte load (2-byte aligned)."""
    if record.RECORDER is not None:
        src = record.RECORDER.twin_global(src, elem, 2, "ld")
    address.check_global(src, elem, 2, "load_u16", "ld.global.u16", "src")
    return _read_flat(src, elem, 1)[0]


def _sim_load_at(src, elem):
    """Twin of :func:`load_at`: one element (aligned to its size: an e4m3 cache's uint32
    words to 4)."""
    if record.RECORDER is not None:
        src = record.RECORDER.twin_global(src, elem, np.dtype(src.dtype).itemsize, "ld")
    _ptr, size = address.pointer_and_size(src)
    address.check_global(src, elem, min(size, 16), "load_at", f"ld.global.b{8 * size}",
                         "src")
    return _read_flat(src, elem, 1)[0]


def _sim_store_at(dst, elem, val):
    """Twin of :func:`store_at`: one element written at its memory place (aligned to its
    size, inside the memory the array spans, else the error the GPU's fault would be)."""
    size = np.dtype(dst.dtype).itemsize
    if record.RECORDER is not None:
        dst = record.RECORDER.twin_global(dst, elem, size, "st")
    address.check_global(dst, elem, min(size, 16), "store_at", f"st.global.b{8 * size}",
                         "dst")
    flat = _host_flat(dst)
    e = int(elem)
    if not 0 <= e < flat.shape[0]:
        raise IndexError(f"store_at: element {e} lies outside dst's memory ({flat.shape[0]} "
                         "elements): an illegal address on the GPU")
    flat[e] = val


def _sim_load16(src, elem):
    """Twin of :func:`load16`: the 16 bytes from element ``elem`` (the address must be
    16-byte aligned, as on the device), in the compute type."""
    if record.RECORDER is not None:
        src = record.RECORDER.twin_global(src, elem, 16, "ld")
    dtype = np.dtype(src.dtype)
    size = _host_flat(src).shape[0]   # the memory it spans (a strided view's too)
    n = 16 // dtype.itemsize
    if dtype not in (np.float16, np.float32, np.float64):
        raise TypeError(f"load16: expected src as a float16, float32 or float64 array, got "
                        f"{dtype}")
    e = int(elem)
    address.check_global(src, e, 16, "load16", LOAD16_PTX, "src",
                         expect="a multiple of 16 bytes as the global address")
    if not 0 <= e <= size - n:
        raise ValueError(f"load16: expected a multiple of {n} (16 bytes from the array's "
                         f"start) with {n} elements inside the array ({size}), got {e}")
    acc = np.float64 if dtype == np.float64 else np.float32
    return tuple(acc(x) for x in _read_flat(src, e, n))


def _sim_lds16(smem, smem_byte):
    """Twin of :func:`lds16`: the 16 bytes from byte ``smem_byte`` (16-byte aligned)."""
    if record.RECORDER is not None:
        smem = record.RECORDER.twin_shared(smem, smem_byte, 16, "ld")
    size = np.dtype(smem.dtype).itemsize
    b = int(smem_byte)
    address.check_shared(smem, b, 16, "lds16", f"ld.shared.v{16 // size}", "smem")
    w = b // size
    flat = smem.reshape(-1)
    return tuple(flat[w + i] for i in range(16 // size))


if on_simulator():
    _WAIT_GROUP = {n: _sim_nothing for n in range(CP_ASYNC_MAX_PENDING + 1)}
    ldmatrix_x4 = _sim_ldmatrix_x4
    ldmatrix_x4_trans = _sim_ldmatrix_x4_trans
    cp_async16 = _sim_cp_async16
    cp_async16_rows = _sim_cp_async16_rows
    cp_async_commit = _sim_nothing
    cp_async_wait_all = _sim_nothing
    cp_async_wait_one = _sim_nothing
    ex2 = _sim_ex2
    fmax = _sim_fmax
    fma = _sim_fma
    shfl_xor = _sim_shfl_xor
    warp_any = _sim_warp_any
    load_u16 = _sim_load_u16
    load_at = _sim_load_at
    store_at = _sim_store_at
    load16 = _sim_load16
    lds16 = _sim_lds16
    red_add = _sim_red_add
    in_loop = _sim_in_loop
    wide_mad = _sim_wide_mad
else:
    _g = _gpu_stages()
    _WAIT_GROUP = _g["cp_async_wait_group"]
    ldmatrix_x4, ldmatrix_x4_trans = _g["ldmatrix_x4"], _g["ldmatrix_x4_trans"]
    cp_async16, cp_async_commit, cp_async_wait_all = (_g["cp_async16"], _g["cp_async_commit"],
                                                      _g["cp_async_wait_all"])
    cp_async_wait_one, cp_async16_rows = _g["cp_async_wait_one"], _g["cp_async16_rows"]
    ex2, fmax, fma, load_u16 = _g["ex2"], _g["fmax"], _g["fma"], _g["load_u16"]
    load16, lds16, load_at, red_add = _g["load16"], _g["lds16"], _g["load_at"], _g["red_add"]
    store_at = _g["store_at"]
    in_loop, wide_mad = _g["in_loop"], _g["wide_mad"]
    del _g


def _gpu_shfl_xor(x, lane_mask):
    return cuda.shfl_xor_sync(0xFFFFFFFF, x, lane_mask)


def _gpu_warp_any(pred):
    return cuda.any_sync(0xFFFFFFFF, pred)


if not on_simulator():
    shfl_xor = device_jit(inline=True)(_gpu_shfl_xor)
    warp_any = device_jit(inline=True)(_gpu_warp_any)


def cp_async_wait(N):
    """``cp.async.wait_group N`` as a device function of no arguments (``N`` a compile-time
    int, 0 .. :data:`CP_ASYNC_MAX_PENDING`): this thread's copy groups have landed but for the
    ``N`` newest.  A pipeline that commits one group per tile (empty ones included) waits for
    tile ``j`` with the number of groups it has committed since."""
    if not 0 <= N <= CP_ASYNC_MAX_PENDING:
        raise ValueError(f"N: expected 0..{CP_ASYNC_MAX_PENDING} pending groups, got {N}")
    return _WAIT_GROUP[N]


# ------------------------------------------------------------------------------------------
# tile copies (plain device functions over the intrinsics: the same source in both backends)
# ------------------------------------------------------------------------------------------
_device = functools.partial(device_jit, inline=True)

_LOG2E_F32 = np.float32(LOG2E)


@functools.lru_cache(maxsize=None)
def make_exp_e(word):
    """``exp_e(x)``, ``exp`` in the compute type of ``word``-byte elements (the SIMT kernels'
    one exponential).  float32 (4): ``ex2.approx(x log2 e)``, one FMUL and one MUFU.EX2
    (libdevice ``expf`` is about 10 instructions; about 2 ulp); ``exp(-inf) = 0``, NaN stays
    NaN.  float64 (8): libdevice ``exp`` (there is no float64 ``ex2.approx``)."""
    if word == 4:
        def exp_e(x):
            return ex2(x * _LOG2E_F32)
    else:
        def exp_e(x):
            return math.exp(x)
    return _device(exp_e)


# [docs:row-dot]
@functools.lru_cache(maxsize=None)
def make_row_dot(TR, TC, A_STEP, B_STEP, ROW_BYTES, acc_t):
    """``row_dot(out, a_tile, b_tile, a_byte, b_byte)``: ``out[i, j] += a . b`` of a thread's
    ``TR`` rows of ``a_tile`` (from byte ``a_byte``, ``A_STEP`` bytes apart) and ``TC`` rows of
    ``b_tile`` (``b_byte``, ``B_STEP`` apart) over ``ROW_BYTES`` of each (the SIMT kernels' ``Q
    K^T`` and ``dO V^T``): per 16-byte chunk one ``ld.shared.v4`` per ``b`` row and per ``a``
    row (``TC + TR`` loads) feed ``TR TC VW`` FMAs, one per column in column order (every
    ``out[i, j]`` sums its products in the same order, whatever the tile).  A ``while`` loop
    over a 32-bit byte offset, not ``range()`` (which Numba lowers with a 64-bit count and a
    sign test per step)."""
    VW = 16 // (8 if acc_t == types.float64 else 4)

    def row_dot(out, a_tile, b_tile, a_byte, b_byte):
        br = cuda.local.array((TC, VW), acc_t)
        off = types.int32(0)
        while off < ROW_BYTES:
            for j in range(TC):
                t = lds16(b_tile, b_byte + off + j * B_STEP)
                for e in range(VW):
                    br[j, e] = t[e]
            for i in range(TR):
                t = lds16(a_tile, a_byte + off + i * A_STEP)
                for e in range(VW):
                    for j in range(TC):
                        out[i, j] += t[e] * br[j, e]
            off = types.int32(off + 16)

    return device_jit(inline=True)(row_dot)
# [/docs:row-dot]


_SHIFT16 = uint32(16)
_LOW16 = uint32(0xFFFF)
_HIGH16 = uint32(0xFFFF0000)


#: the 16-byte chunks of a tile a thread copies (:func:`_chunk_plan`)
ChunkPlan = namedtuple("ChunkPlan", "CT STEP COPIES EXACT PER_ROW")


def _chunk_plan(ROWS, HEAD_DIM, THREADS, STRIDED=False):
    """A :data:`ChunkPlan` ``(CT, STEP, COPIES, EXACT, PER_ROW)``: the 16-byte chunks of a
    ``ROWS x HEAD_DIM`` tile a thread copies.  ``CT`` consecutive threads share a row (the chunk
    count's largest common divisor with ``THREADS``, all of them when it divides ``THREADS``);
    thread ``tid`` takes chunk columns ``tid % CT + CT j`` (``j < PER_ROW``: one unless the chunk
    count does not divide ``THREADS``, e.g. 24 chunks of a 192-wide row on 32 threads: 8 a row, 3
    columns each) of rows ``tid // CT + STEP i`` (``i < COPIES``; ``EXACT``: every such row is
    inside the tile).  Fixed columns: the copy's and the scan's per-thread offsets are computed
    once."""
    CHUNKS = HEAD_DIM // 8                 # 16-byte chunks per row
    assert HEAD_DIM % 8 == 0, HEAD_DIM
    CT = math.gcd(CHUNKS, THREADS)         # threads per row
    if STRIDED and CT > 8 and CT % 8 == 0:   # 8 (128 bytes, a line, a row): a strided copy's
        CT = 8                                # row address serves PER_ROW chunks (immediates)
    STEP = THREADS // CT                   # rows between a thread's consecutive rows
    COPIES = -(-ROWS // STEP)              # rows per thread (the last may lie past ROWS)
    return ChunkPlan(CT, STEP, COPIES, ROWS % STEP == 0, CHUNKS // CT)


@functools.lru_cache(maxsize=None)
def make_tile_copy(ROWS, HEAD_DIM, ROW_BYTES, THREADS, VEC, PAD=False, STRIDED=False):
    """``copy_tile(smem, smem_byte, src, elem_base, rows_valid, d, tid)``: see
    :func:`_tile_copies`."""
    return _tile_copies(ROWS, HEAD_DIM, ROW_BYTES, THREADS, VEC, PAD, STRIDED)[0]


@functools.lru_cache(maxsize=None)
def make_tile_copy_at(ROWS, HEAD_DIM, ROW_BYTES, THREADS, VEC, PAD=False):
    """``copy_at(smem, smem_byte, src, elem_base, first, rows_valid, d, tid)``: the strided
    :func:`make_tile_copy` of the tile ``first`` rows (an int32) past ``elem_base`` (the
    operand's own row 0, the same every tile): a full tile's row ``r`` is one ``mad.wide`` of
    ``first + r`` from a per-thread address that stays put across the caller's loop, where
    ``copy_tile`` of the tile's own start costs a 64-bit product and add each tile."""
    return _tile_copies(ROWS, HEAD_DIM, ROW_BYTES, THREADS, VEC, PAD, True)[1]


def _tile_copies(ROWS, HEAD_DIM, ROW_BYTES, THREADS, VEC, PAD=False, STRIDED=False):
    """``(copy_tile, copy_at)`` (``copy_at`` None without ``STRIDED``).  ``copy_tile(smem,
    smem_byte, src, elem_base, rows_valid, d, tid)``: rows
    ``0 .. ROWS-1`` of the tile whose row 0 is element ``elem_base`` of ``src`` (row stride
    ``d``) into shared rows ``smem_byte + row * ROW_BYTES``; rows ``>= rows_valid`` (and, with
    ``VEC=False``, columns ``>= d``) as zeros.  ``VEC`` (``d == HEAD_DIM``, 16-byte aligned
    rows): ``cp.async``, the caller commits and waits; else 16-bit loads and shared stores.
    ``PAD`` (with ``VEC``): ``d`` is any multiple of 8 up to ``HEAD_DIM`` (16-byte aligned
    rows of ``d``): the 16-byte chunks past ``d`` are zero-filled without a read (a thread's
    chunk column is fixed, so one test a tile), the stride is ``d``: two widths of one tile
    (a value head dim of its own) at ``cp.async`` speed.  ``STRIDED``: ``d`` is the pair ``(d,
    row_stride)``, rows ``row_stride`` elements apart in memory (a strided view's; with
    ``VEC`` a multiple of 8)."""
    plan = _chunk_plan(ROWS, HEAD_DIM, THREADS, STRIDED)
    CT, STEP, COPIES, EXACT, PER_ROW = plan.CT, plan.STEP, plan.COPIES, plan.EXACT, plan.PER_ROW
    assert ROW_BYTES % 16 == 0 and ROW_BYTES >= 2 * HEAD_DIM

    if STRIDED:
        @_device
        def width_and_stride(dd):
            return dd[0], dd[1]
    else:
        @_device
        def width_and_stride(dd):   # a contiguous tile's row stride: its width (HEAD_DIM: VEC)
            return dd, (HEAD_DIM if VEC and not PAD else dd)

    @_device
    def copy_column(smem, smem_byte, src, elem_base, rows_valid, dd, row0, col):
        """Chunk column ``col`` of this thread's rows ``row0 + STEP i``."""
        d, stride = width_and_stride(dd)
        dst0 = smem_byte + row0 * ROW_BYTES + 16 * col
        if VEC:
            if STRIDED:   # (an int32 stride: one IMAD.WIDE)
                src0 = elem_base + wide_mad(row0, stride, 8 * col)
            else:
                src0 = elem_base + row0 * stride + 8 * col
            live = 8 * col < d if PAD else True   # (PAD) this thread's chunk holds data
            if rows_valid >= ROWS:          # full tile: no per-row test
                for i in range(COPIES):
                    if EXACT or row0 + i * STEP < ROWS:
                        if PAD:
                            cp_async16(smem, dst0 + i * STEP * ROW_BYTES, src,
                                       src0 + i * STEP * stride if live else elem_base,
                                       16 if live else 0)
                        else:
                            cp_async16(smem, dst0 + i * STEP * ROW_BYTES, src,
                                       src0 + i * STEP * stride, 16)
            else:                           # boundary tile: rows past the end read nothing
                for i in range(COPIES):
                    row = row0 + i * STEP
                    if STRIDED:
                        row = int32(row)   # 32-bit row tests
                    if EXACT or row < ROWS:
                        ok = row < rows_valid and live
                        cp_async16(smem, dst0 + i * STEP * ROW_BYTES, src,
                                   src0 + i * STEP * stride if ok else elem_base,
                                   16 if ok else 0)
        else:
            for i in range(COPIES):
                row = row0 + i * STEP
                if EXACT or row < ROWS:
                    base = elem_base + row * stride
                    w0 = (dst0 + i * STEP * ROW_BYTES) >> 2
                    for w in range(4):
                        c = 8 * col + 2 * w
                        lo = uint32(0)
                        hi = uint32(0)
                        if row < rows_valid:
                            if c < d:
                                lo = uint32(load_u16(src, base + c))
                            if c + 1 < d:
                                hi = uint32(load_u16(src, base + c + 1))
                        smem[w0 + w] = uint32(lo | uint32(hi << _SHIFT16))

    @_device
    def copy_columns(smem, smem_byte, src, elem_base, first, rows_valid, dd, row0, col0):
        """(``STRIDED``) chunk columns ``col0 + CT j`` of this thread's rows of the tile
        ``first`` rows past ``elem_base``.  A full tile (``VEC``, no ``PAD``): row ``r``'s
        address is one ``mad.wide.s32`` of ``first + r`` from the thread's column in row 0
        (:func:`cp_async16_rows`; that address stays put across the caller's loop), its
        ``PER_ROW`` chunks at immediate offsets along the row."""
        stride = dd[1]
        if VEC and not PAD and rows_valid >= ROWS:
            dst0 = smem_byte + row0 * ROW_BYTES + 16 * col0
            src0 = elem_base + 8 * col0
            r0 = int32(first + row0)
            for i in range(COPIES):
                if EXACT or row0 + i * STEP < ROWS:
                    for j in range(PER_ROW):
                        cp_async16_rows(smem, dst0 + i * STEP * ROW_BYTES + 16 * CT * j, src,
                                        src0, stride, r0 + i * STEP, 8 * CT * j)
        else:
            base = wide_mad(first, stride, elem_base)
            for j in range(PER_ROW):
                copy_column(smem, smem_byte, src, base, rows_valid, dd, row0, col0 + CT * j)

    if STRIDED:
        @_device
        def copy_at(smem, smem_byte, src, elem_base, first, rows_valid, d, tid):
            t = uint32(tid)   # unsigned 32-bit: a shift and a mask, cheap to recompute
            copy_columns(smem, smem_byte, src, elem_base, first, rows_valid, d,
                         int32(t // uint32(CT)), int32(t % uint32(CT)))

        @_device
        def copy_tile(smem, smem_byte, src, elem_base, rows_valid, d, tid):
            copy_at(smem, smem_byte, src, elem_base, int32(0), rows_valid, d, tid)

        return copy_tile, copy_at
    elif PER_ROW == 1:   # a thread's one chunk column (every power-of-two width)
        @_device
        def copy_tile(smem, smem_byte, src, elem_base, rows_valid, d, tid):
            copy_column(smem, smem_byte, src, elem_base, rows_valid, d, tid // CT, tid % CT)
    else:                # its PER_ROW columns, CT chunks apart
        @_device
        def copy_tile(smem, smem_byte, src, elem_base, rows_valid, d, tid):
            for j in range(PER_ROW):
                copy_column(smem, smem_byte, src, elem_base, rows_valid, d, tid // CT,
                            tid % CT + CT * j)

    return copy_tile, None


@functools.lru_cache(maxsize=None)
def make_row_stride(STRIDED):
    """``row_stride(d)``: the elements between two rows of a tile's source, from the ``d`` a
    tile copy takes (:func:`make_tile_copy`): the head dim of a C-contiguous array, or
    (``STRIDED``) the pair ``(d, row stride)`` of a strided view."""
    if STRIDED:
        @_device
        def row_stride(dd):
            return dd[1]
    else:
        @_device
        def row_stride(dd):
            return dd

    return row_stride


@functools.lru_cache(maxsize=None)
def make_tile_rows(ROWS):
    """``tile_rows(elem_base, t, n, row_stride)`` of a strided copy: ``(base, rows)``, where
    tile ``t`` of ``ROWS`` rows of an ``n``-row source starts and how many of its rows lie
    before ``n``: in 32 bits (the row counts) and one :func:`wide_mad` (``IMAD.WIDE``) of the
    int32 row stride, where Numba's 64-bit product of the widened values costs three ``IMAD``
    and an add (the warpgroup copies; the contiguous builds keep their own lines)."""
    @_device
    def tile_rows(elem_base, t, n, row_stride):
        first = int32(t * ROWS)
        return wide_mad(first, row_stride, elem_base), min(int32(ROWS), int32(int32(n) - first))

    return tile_rows


@functools.lru_cache(maxsize=None)
def make_pair_load(ROWS, HEAD_DIM, ROW_BYTES, THREADS, VEC, SECOND, PER_TILE=False,
                   OWN_Y=False, Y_DIM=0, PAD=None, STRIDED=False):
    """``load_pair(smem, byte, x, y, elem_base, t, t_hi, n, d, tid, y_at)``: rows ``t ROWS ..``
    of ``x`` to ``byte`` and of ``y`` to ``byte + SECOND`` (:func:`make_tile_copy`; both ``[..,
    n, d]`` from element ``elem_base``), as one copy group, an empty one once ``t >= t_hi`` (so
    that a pipeline commits the same number of groups every step).  ``OWN_Y``: ``y`` is ``[..,
    n, d_y]`` from its own element ``y_base``, ``y_at = (y_base, d_y)`` (ignored without), in a
    tile ``Y_DIM`` wide (0: ``HEAD_DIM``; its rows :func:`~numba_flash.kernels.core.config.
    mma_row_bytes` of it); ``PAD`` (default ``OWN_Y``): a width may lie below its tile's, the
    copies' chunk-granular zero fill (:func:`make_tile_copy`'s ``PAD``).  ``STRIDED``: ``d``
    and ``y_at[1]`` are the pairs ``(width, row stride)`` of strided views, ``y`` always from
    ``y_at`` (its strides are its own).  ``PER_TILE``: the
    thread's chunk offsets are computed per call (:func:`in_loop`), not held in registers
    across the caller's loop (the dK/dV kernel at 255 registers; elsewhere they cost 10% more
    instructions for nothing)."""
    PAD = OWN_Y if PAD is None else PAD
    copy = make_tile_copy(ROWS, HEAD_DIM, ROW_BYTES, THREADS, VEC, PAD, STRIDED)
    copy_y = copy if not Y_DIM else make_tile_copy(ROWS, Y_DIM, mma_row_bytes(Y_DIM), THREADS,
                                                   VEC, PAD, STRIDED)
    copy_at = copy_y_at = None
    if STRIDED:   # each operand's own row 0 and the tile's first row (make_tile_copy_at)
        copy_at = make_tile_copy_at(ROWS, HEAD_DIM, ROW_BYTES, THREADS, VEC, PAD)
        copy_y_at = copy_at if not Y_DIM else make_tile_copy_at(
            ROWS, Y_DIM, mma_row_bytes(Y_DIM), THREADS, VEC, PAD)
    row_stride = make_row_stride(STRIDED)
    OWN_AT = OWN_Y or STRIDED   # y from its own base (and stride)

    @_device
    def load_pair(smem, byte, x, y, elem_base, t, t_hi, n, d, tid, y_at):
        if t < t_hi:
            if STRIDED:   # 32-bit rows; each operand from its own row 0 (make_tile_copy_at)
                first = int32(t * ROWS)
                rows = min(int32(ROWS), int32(int32(n) - first))   # in 1 .. ROWS
                if PER_TILE:
                    tid = in_loop(int32(tid))
                copy_at(smem, byte, x, elem_base, first, rows, d, tid)
                copy_y_at(smem, byte + SECOND, y, y_at[0], first, rows, y_at[1], tid)
            else:
                rows = int32(min(ROWS, n - t * ROWS))   # in 1 .. ROWS: 32-bit row tests
                base = elem_base + t * ROWS * row_stride(d)
                if PER_TILE:
                    tid = in_loop(int32(tid))
                copy(smem, byte, x, base, rows, d, tid)
                if OWN_AT:
                    copy_y(smem, byte + SECOND, y, y_at[0] + t * ROWS * row_stride(y_at[1]),
                           rows, y_at[1], tid)
                else:
                    copy(smem, byte + SECOND, y, base, rows, d, tid)
        cp_async_commit()

    return load_pair


@functools.lru_cache(maxsize=None)
def make_zero_nonfinite_word(DTYPE="float16"):
    """``zero_nonfinite_word(x)``: a word of two 16-bit elements of ``DTYPE`` (``"float16"`` or
    ``"bfloat16"``) with each inf / NaN one (all exponent bits set, :data:`EXP_BITS`) replaced
    by +0."""
    if DTYPE not in EXP_BITS:
        raise ValueError(f"DTYPE: expected one of {tuple(EXP_BITS)}, got {DTYPE!r}")
    EXP_LO = uint32(EXP_BITS[DTYPE])
    EXP_HI = uint32(EXP_BITS[DTYPE] << 16)

    @_device
    def zero_nonfinite_word(x):
        if (x & EXP_LO) == EXP_LO:
            x = uint32(x & _HIGH16)
        if (x & EXP_HI) == EXP_HI:
            x = uint32(x & _LOW16)
        return x

    return zero_nonfinite_word


#: the float16 build of :func:`make_zero_nonfinite_word`
zero_nonfinite_word = make_zero_nonfinite_word("float16")


@functools.lru_cache(maxsize=None)
def make_tile_scan(ROWS, HEAD_DIM, ROW_BYTES, THREADS, DTYPE="float16", PER_TILE=False,
                   STRIDED=False):
    """``zero_nonfinite(smem, smem_byte, rows, tid)``: the chunks :func:`make_tile_copy` gave
    thread ``tid`` in the tile's first ``rows`` rows (readable by it after its own wait, no
    barrier; the copy zero-filled the others), every inf / NaN element (of the 16-bit type
    ``DTYPE``, ``"float16"`` or ``"bfloat16"``) set to +0; True if there was one.  Other
    threads see the result after a barrier.  A loop over run-time rows, one chunk at a time:
    unrolled, the loads of every chunk would be in flight together (a d = 128 tile of 32 rows
    on 64 threads: 32 registers).  ``PER_TILE``: the thread's offsets computed per call
    (:func:`in_loop`), not held across the caller's loop (as :func:`make_pair_load`).
    ``STRIDED``: the copy's (its chunk plan: a strided copy's rows take at most 8 threads)."""
    plan = _chunk_plan(ROWS, HEAD_DIM, THREADS, STRIDED)   # the copy's chunks, this thread's
    CT, STEP, PER_ROW = plan.CT, plan.STEP, plan.PER_ROW
    zero_word = make_zero_nonfinite_word(DTYPE)
    STEP_WORDS = STEP * ROW_BYTES // 4

    @_device
    def zero_nonfinite(smem, smem_byte, rows, tid):
        bad = False
        if PER_TILE:
            tid = in_loop(int32(tid))
        row = int32(tid // CT)
        idx = int32((smem_byte + row * ROW_BYTES + 16 * (tid % CT)) >> 2)
        end = int32(min(rows, ROWS))   # 32-bit: the loop's count and addresses in one register
        while row < end:
            for e in range(4 * PER_ROW):   # the thread's chunk columns, CT chunks apart
                at = idx + 4 * CT * (e // 4) + e % 4
                x = smem[at]
                y = zero_word(x)
                if y != x:
                    smem[at] = y
                    bad = True
            row = int32(row + STEP)
            idx = int32(idx + STEP_WORDS)
        return bad

    return zero_nonfinite


# ------------------------------------------------------------------------------------------
# test and compile-tier kernels
# ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def ldmatrix_kernel(TRANS):
    """``kernel(tile, rows, regs)``: one warp; ``tile`` uint32 ``[64 * 4]`` (64 rows of 8
    halves) goes to shared memory, lane ``l`` points at row ``rows[l]`` and ``regs[l]`` gets the
    four registers of ``ldmatrix .x4`` (``.trans`` with ``TRANS``)."""

    @kernel_jit
    def ldmatrix_probe(tile, rows, regs):
        lane = cuda.threadIdx.x
        smem = cuda.shared.array(256, types.uint32)
        for i in range(lane, 256, WARP):
            smem[i] = tile[i]
        cuda.syncthreads()  # the tile is in shared memory before any lane's ldmatrix reads it
        if TRANS:
            r0, r1, r2, r3 = ldmatrix_x4_trans(smem, 16 * rows[lane])
        else:
            r0, r1, r2, r3 = ldmatrix_x4(smem, 16 * rows[lane])
        regs[lane, 0] = r0
        regs[lane, 1] = r1
        regs[lane, 2] = r2
        regs[lane, 3] = r3

    return ldmatrix_probe


@functools.lru_cache(maxsize=None)
def tile_copy_kernel(ROWS, HEAD_DIM, THREADS, VEC, TILES, DTYPE="float16"):
    """``kernel(src, out, d, n_rows, flags)``: ``TILES`` consecutive ``ROWS``-row tiles of the
    ``[n_rows, d]`` float16 bits ``src`` through a double buffer of shared memory (tile ``j + 1``
    copied under the read-out of tile ``j``, one barrier per tile); ``out [TILES, ROWS,
    HEAD_DIM]`` gets each tile as shared memory held it when read (zeros past the end) and
    ``flags[j]`` = 1 if :func:`make_tile_scan` found a non-finite value (those read as 0) of the
    16-bit type ``DTYPE`` (``src`` holds its bits)."""
    RB = row_bytes(HEAD_DIM)
    BUF = ROWS * RB
    WORDS = 2 * BUF // 4
    copy = make_tile_copy(ROWS, HEAD_DIM, RB, THREADS, VEC)
    scan = make_tile_scan(ROWS, HEAD_DIM, RB, THREADS, DTYPE)

    @kernel_jit
    def tile_copy(src, out, d, n_rows, flags):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(WORDS, types.uint32)
        copy(smem, 0, src, 0, min(ROWS, n_rows), d, tid)
        cp_async_commit()
        for j in range(TILES):
            cp_async_wait_all()
            cuda.syncthreads()  # tile j landed everywhere; nobody still reads buffer (j+1) % 2
            if j + 1 < TILES:
                nxt = (j + 1) * ROWS
                copy(smem, ((j + 1) & 1) * BUF, src, nxt * d, min(ROWS, n_rows - nxt), d, tid)
                cp_async_commit()
            bad = cuda.syncthreads_or(  # + barrier
                1 if scan(smem, (j & 1) * BUF, min(ROWS, n_rows - j * ROWS), tid) else 0)
            if tid == 0:
                flags[j] = 1 if bad else 0
            base = (j & 1) * BUF // 4
            for idx in range(tid, ROWS * HEAD_DIM // 2, THREADS):
                r = idx // (HEAD_DIM // 2)
                w = idx % (HEAD_DIM // 2)
                x = smem[base + r * (RB // 4) + w]
                out[j, r, 2 * w] = uint32(x & _LOW16)
                out[j, r, 2 * w + 1] = uint32(x >> _SHIFT16)

    return tile_copy


@functools.lru_cache(maxsize=None)
def load16_kernel(N):
    """``kernel(src, elems, out)``: thread ``i`` stores :func:`load16` of ``src`` at flat
    element ``elems[i]`` into ``out[i, :N]`` (``N = 16 / src.itemsize``)."""

    @kernel_jit
    def load16_probe(src, elems, out):
        i = cuda.grid(1)
        if i < elems.shape[0]:
            vals = load16(src, elems[i])
            for j in range(N):
                out[i, j] = vals[j]

    return load16_probe


@functools.lru_cache(maxsize=None)
def red_add_kernel():
    """``kernel(dst, elems, vals)``: thread ``i`` does :func:`red_add` ``(dst, elems[i],
    vals[i])`` (many threads on one element: the adds must all land)."""

    @kernel_jit
    def red_add_probe(dst, elems, vals):
        i = cuda.grid(1)
        if i < elems.shape[0]:
            red_add(dst, elems[i], vals[i])

    return red_add_probe


@functools.lru_cache(maxsize=None)
def arith_kernel():
    """``kernel(x, y, out)``: ``out[i] = (ex2(x), fmax(x, y), fma(x, y, x))`` per element."""

    @kernel_jit
    def arith(x, y, out):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i, 0] = ex2(x[i])
            out[i, 1] = fmax(x[i], y[i])
            out[i, 2] = fma(x[i], y[i], x[i])

    return arith
