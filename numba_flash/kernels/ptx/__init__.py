"""Inline-PTX primitives (mma.sync, wgmma, copies, ldmatrix, cp.async, ex2), each with its
simulator twin.  In the simulator, importing this package installs the launch checks of
:mod:`~numba_flash.kernels.ptx.address` (every array argument aligned to its element size; the
twins check each instruction's own rule)."""

from ...backend import on_simulator

if on_simulator():
    from . import address as _address

    _address.install()
