"""What every kernel configuration shares (the analog of FA2's ``Kernel_traits``): the 16-bit
element types of the tensor-core kernels, padded shared rows, the derived-size properties of the
tensor-core configurations and their compile-tier names.

Each family's configuration lives in its own ``config.py``
(:mod:`numba_flash.kernels.forward.config`, :mod:`numba_flash.kernels.backward.config`,
:mod:`numba_flash.kernels.decode.config`): one named tuple per kernel, its derived sizes as
properties, and one tile-choice function whose comments say which limit each choice hits.  A kernel
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

#: the 16-bit element types of the tensor-core kernels
MMA_DTYPES = ("float16", "bfloat16")


def mma_row_bytes(head_dim):
    """Bytes of one shared row of ``head_dim`` 16-bit elements, padded by 16 so that the 8 rows
    of an ``ldmatrix`` fall in 8 distinct 16-byte bank groups."""
    return 2 * head_dim + 16


def round16(head_dim):
    """``head_dim`` rounded up to a multiple of 16 (an ``mma`` k-step)."""
    return -(-head_dim // 16) * 16


#: properties of every tensor-core configuration: threads of a block (32 a warp) and the bytes
#: of a padded shared row; a V tile's width and row bytes (a value head dim of its own)
_THREADS = property(lambda cfg: 32 * cfg.NUM_WARPS, doc="Threads of a block: 32 a warp.")
_ROW_BYTES = property(lambda cfg: mma_row_bytes(cfg.HEAD_DIM), doc="Bytes of a shared row.")
_OWNED_ROWS = property(lambda cfg: 16 * cfg.M_TILES * cfg.NUM_WARPS,
                       doc="Rows a block owns: 16 per row tile of each warp.")
_V_DIM = property(lambda cfg: cfg.HEAD_DIM_V or cfg.HEAD_DIM,
                  doc="The V tile's (and dO's, o's, dV's) compile-time width: HEAD_DIM_V, or "
                      "HEAD_DIM.")
_V_ROW_BYTES = property(lambda cfg: mma_row_bytes(cfg.V_DIM), doc="Bytes of a shared V row.")


def _flags_name(cfg):
    """The compile tier's words for a tensor-core configuration's flags."""
    return "".join(f" {n}" for n, f in (("dropout", cfg.DROPOUT), ("softcap", cfg.SOFTCAP),
                                         ("alibi", cfg.ALIBI), ("ld16", not cfg.VEC),
                                         ("score_mod mask_mod block_mask",
                                          cfg.USER is not None),
                                         ("own d_v", getattr(cfg, "OWN_V", False))) if f)
