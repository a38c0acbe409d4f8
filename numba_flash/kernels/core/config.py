"""What every kernel configuration shares (the analog of FA2's ``Kernel_traits``): the 16-bit
element types of the tensor-core kernels, padded shared rows, the derived-size properties of the
tensor-core configurations and their compile-tier names.

Each family's configuration lives in its own ``config.py``
(:mod:`numba_flash.kernels.forward.config`, :mod:`numba_flash.kernels.backward.config`,
:mod:`numba_flash.kernels.decode.config`): one frozen dataclass per kernel (fields given by name;
the shared ones in :class:`KernelConfig`, :class:`TensorCoreConfig` and :class:`WarpMmaConfig`
here), its derived sizes as properties, and one tile-choice function whose comments say which
limit each choice hits.  A kernel
factory takes its configuration (compile-time constants); the ops ask the tile-choice function for
the configuration of a call; the compile tier lists the configurations the tile choices produce and
the test suite selects among them by their fields, never by name
(:func:`numba_flash.tools.compile_check.in_suite`).  So a new tile shape is one line in a family's
table.

Limits the choices meet (per block, sm_80 and sm_90): static shared memory <= 48 KiB
(:data:`~numba_flash.kernels.core.common.SMEM_LIMIT`; the wgmma forward opts in to more, as
dynamic shared memory), no register spill and no stack frame (the compile tier fails on either),
255 registers per thread.
"""

from __future__ import annotations

import dataclasses

import numpy as np

#: the 16-bit element types of the tensor-core kernels
MMA_DTYPES = ("float16", "bfloat16")


def mma_row_bytes(head_dim):
    """Bytes of one shared row of ``head_dim`` 16-bit elements, padded by 16 so that the 8 rows
    of an ``ldmatrix`` fall in 8 distinct 16-byte bank groups."""
    return 2 * head_dim + 16


def round16(head_dim):
    """``head_dim`` rounded up to a multiple of 16 (an ``mma`` k-step)."""
    return -(-head_dim // 16) * 16


#: every kernel configuration: a frozen dataclass (hashable, so a kernel factory's cache key) whose
#: fields are named where it is built, never given by position
kernel_config = dataclasses.dataclass(frozen=True, kw_only=True)


@kernel_config
class KernelConfig:
    """What every family's configuration holds: the compile-time ``HEAD_DIM``, the input element
    type ``DTYPE`` (a NumPy dtype's name; the SIMT backward's, the dtype) and ``USER``, a user's
    variant (its device functions and block-mask tiles, :mod:`numba_flash.flex`) or None."""

    HEAD_DIM: int
    DTYPE: object
    USER: object = None

    @property
    def np_dtype(self):
        """The NumPy dtype of ``DTYPE`` (bfloat16: ml_dtypes', the name NumPy does not know)."""
        from .elements import BFLOAT16

        return np.dtype(BFLOAT16) if str(self.DTYPE) == "bfloat16" else np.dtype(self.DTYPE)


@kernel_config
class TensorCoreConfig(KernelConfig):
    """The flags of the tensor-core kernels (``mma.sync`` and ``wgmma``): the 16-bit ``DTYPE``,
    per-element work built in (``DROPOUT``, ``SOFTCAP``, ``ALIBI``) and ``VEC`` (16-byte
    copies of whole tiles; off, 16-bit loads with every element's bound tested)."""

    DTYPE: str = "float16"
    DROPOUT: bool = False
    SOFTCAP: bool = False
    ALIBI: bool = False
    VEC: bool = True

    @property
    def flags_name(self):
        """The compile tier's words for the flags, e.g. `` dropout softcap``."""
        return "".join(f" {n}" for n, f in (("dropout", self.DROPOUT), ("softcap", self.SOFTCAP),
                                             ("alibi", self.ALIBI), ("ld16", not self.VEC),
                                             ("score_mod mask_mod block_mask",
                                              self.USER is not None),
                                             ("own d_v", getattr(self, "OWN_V", False)),
                                             ("strided", getattr(self, "STRIDED", False)))
                       if f)


@kernel_config
class WarpMmaConfig(TensorCoreConfig):
    """What the ``mma.sync`` kernels' configurations share (the forward's and the backward's):
    ``NUM_WARPS`` warps of ``M_TILES`` 16-row tiles, ``STAGES`` buffers of the streamed
    operands, padded shared rows; ``OWN_V``: ``v`` has a head dim of its own, in tiles
    ``HEAD_DIM_V`` wide (0: ``HEAD_DIM``; off, V shares K's width and addresses)."""

    NUM_WARPS: int
    M_TILES: int
    STAGES: int = 2
    OWN_V: bool = False
    HEAD_DIM_V: int = 0

    @property
    def THREADS(self):
        """Threads of a block: 32 a warp."""
        return 32 * self.NUM_WARPS

    @property
    def OWNED_ROWS(self):
        """Rows a block owns: 16 per row tile of each warp."""
        return 16 * self.M_TILES * self.NUM_WARPS

    @property
    def ROW_BYTES(self):
        """Bytes of a padded shared row of ``HEAD_DIM`` elements."""
        return mma_row_bytes(self.HEAD_DIM)

    @property
    def V_DIM(self):
        """The V tile's (and dO's, o's, dV's) compile-time width: ``HEAD_DIM_V``, or
        ``HEAD_DIM``."""
        return self.HEAD_DIM_V or self.HEAD_DIM

    @property
    def V_ROW_BYTES(self):
        """Bytes of a padded shared V row."""
        return mma_row_bytes(self.V_DIM)
