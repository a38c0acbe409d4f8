"""Block masks: a ``mask_mod`` evaluated once per (query block, key block) of the tile grid.

A kernel that takes a ``mask_mod`` must evaluate it on every (query, key) element it computes;
a document mask over N tokens then still costs N^2 work.  :func:`create_block_mask` evaluates
the mask once, on the host, and classifies each ``[Q_BLOCK x KV_BLOCK]`` block of the score
matrix of each ``(b, h)``:

* ``EMPTY`` (0): the mask is False everywhere in the block: a kernel never loads its keys;
* ``PARTIAL`` (1): mixed: a kernel computes the block and applies ``mask_mod`` per element;
* ``FULL`` (2): True everywhere: a kernel computes the block without calling ``mask_mod``.

The layout of FlexAttention's ``BlockMask`` is derived from the classification:
``kv_num_blocks[b, h, i]`` partial key blocks of query block ``i``, listed in increasing order
in ``kv_indices[b, h, i, :kv_num_blocks]`` (the rest of the row is -1), and
``full_kv_num_blocks`` / ``full_kv_indices`` for the full ones; ``q_num_blocks`` /
``q_indices`` and ``full_q_*`` are the same lists per key block (the backward's loop runs over
key blocks outside, query blocks inside).

Any block size works with any kernel tile: a kernel tile takes the verdict of every block it
overlaps (EMPTY only if all are, FULL only if all are;
:func:`numba_flash.kernels.mainloop.visibility.make_tile_kind`), so blocks that are multiples of the
kernels' tiles (the default 128) lose nothing.  ``B`` or ``H`` of 1 broadcasts over the batch
or the heads, as FlexAttention's ``B=None`` / ``H=None``: the mask is evaluated with ``b = 0``
(``h = 0``) and must not depend on it.

Evaluation runs the ``mask_mod`` compiled for the CPU (``numba.njit``, bounds-checked: an aux
index out of range is an ``IndexError`` naming ``mask_mod``, its arguments and the aux tensor),
one call per element: about a nanosecond each, so a 32k x 32k mask for one head takes about a
second.  ``aux_tensors``
must be NumPy arrays here (copy device arrays to the host for this call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import describe_aux, locate_host_error
from .functions import check_aux_tensors, check_host_types, check_mod

__all__ = ["BlockMask", "create_block_mask", "EMPTY", "PARTIAL", "FULL", "DEFAULT_BLOCK_SIZE"]

EMPTY, PARTIAL, FULL = 0, 1, 2

#: FlexAttention's default sparse block (a multiple of every tile our kernels use)
DEFAULT_BLOCK_SIZE = 128

_classify_jit = None


def _classifier():
    """The jitted evaluation loop, built on first use (keeps ``import numba_flash`` light)."""
    global _classify_jit
    if _classify_jit is None:
        from numba import njit

        @njit(cache=False)
        def classify(mask_fn, B, H, Nq, Nk, QB, KB, aux, out):
            for b in range(B):
                for h in range(H):
                    for bi in range(out.shape[2]):
                        for bj in range(out.shape[3]):
                            seen = 0
                            n = 0
                            for i in range(bi * QB, min((bi + 1) * QB, Nq)):
                                for j in range(bj * KB, min((bj + 1) * KB, Nk)):
                                    n += 1
                                    if mask_fn(b, h, i, j, *aux):
                                        seen += 1
                            out[b, h, bi, bj] = 0 if seen == 0 else (2 if seen == n else 1)

        _classify_jit = classify
    return _classify_jit


def _ordered(kind, value, axis):
    """``(num, indices)`` of the blocks of ``kind == value`` along ``axis`` (3: key blocks of
    each query block; 2: query blocks of each key block), indices ascending, padded with -1."""
    sel = kind == value
    if axis == 2:
        sel = np.swapaxes(sel, 2, 3)
    num = sel.sum(axis=3).astype(np.int32)
    width = sel.shape[3]
    # a stable sort of "not selected" puts the selected block indices first, in order
    order = np.argsort(~sel, axis=3, kind="stable").astype(np.int32)
    idx = np.where(np.arange(width)[None, None, None, :] < num[..., None], order, -1)
    return num, idx.astype(np.int32)


def _block_list(value, axis, part, what):
    """A read-only property: part ``part`` of :func:`_ordered` of the mask's ``kind`` (0: the
    number of blocks, int32 ``[B, H, rows]``; 1: their indices, int32 ``[B, H, rows, width]``,
    -1 past the number)."""
    name = ("the number of the ", "the indices of the ")[part] + what
    return property(lambda self: _ordered(self.kind, value, axis)[part], doc=name)


@dataclass(frozen=True)
class BlockMask:
    """The classification of every block, and FlexAttention's index lists derived from it.

    ``kind``: int8 ``[B, H, ceil(Nq / Q_BLOCK), ceil(Nk / KV_BLOCK)]`` of EMPTY / PARTIAL / FULL.
    """

    kind: np.ndarray
    shape: tuple
    Q_BLOCK: int
    KV_BLOCK: int
    mask_mod: object = field(repr=False)
    aux_tensors: tuple = field(repr=False, default=())

    # FlexAttention's index lists (see the module docstring), derived from ``kind`` on access
    kv_num_blocks = _block_list(PARTIAL, 3, 0, "partial key blocks of each query block")
    kv_indices = _block_list(PARTIAL, 3, 1, "partial key blocks of each query block")
    full_kv_num_blocks = _block_list(FULL, 3, 0, "full key blocks of each query block")
    full_kv_indices = _block_list(FULL, 3, 1, "full key blocks of each query block")
    q_num_blocks = _block_list(PARTIAL, 2, 0, "partial query blocks of each key block")
    q_indices = _block_list(PARTIAL, 2, 1, "partial query blocks of each key block")
    full_q_num_blocks = _block_list(FULL, 2, 0, "full query blocks of each key block")
    full_q_indices = _block_list(FULL, 2, 1, "full query blocks of each key block")

    def sparsity(self):
        """The fraction of blocks a kernel skips (EMPTY), over all ``(b, h)``."""
        return float(np.mean(self.kind == EMPTY))

    def to_dense(self):
        """The element mask ``[B, H, Nq, Nk]`` (bool), evaluated per element from ``mask_mod``
        in plain Python (for tests and pictures: slow)."""
        B, H, Nq, Nk = self.shape
        out = np.zeros(self.shape, dtype=bool)
        for b in range(B):
            for h in range(H):
                for i in range(Nq):
                    for j in range(Nk):
                        out[b, h, i, j] = bool(self.mask_mod(b, h, i, j, *self.aux_tensors))
        return out

    def __str__(self):
        B, H, Nq, Nk = self.shape
        sym = {EMPTY: ".", PARTIAL: "x", FULL: "#"}
        rows = ["".join(sym[int(c)] for c in row) for row in self.kind[0, 0]]
        return (f"BlockMask(shape={self.shape}, blocks {self.Q_BLOCK}x{self.KV_BLOCK}, "
                f"sparsity {self.sparsity():.1%}; (b, h) = (0, 0): '.' empty, 'x' partial, "
                f"'#' full)\n" + "\n".join(rows))


def _check_size(name, value, lo=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if int(value) < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {int(value)}")
    return int(value)


def create_block_mask(mask_mod, B, H, Nq, Nk, aux_tensors=(), BLOCK_SIZE=DEFAULT_BLOCK_SIZE):
    """Evaluate ``mask_mod(b, h, q_idx, kv_idx, *aux_tensors)`` over ``[B, H, Nq, Nk]`` and
    classify each block (see the module docstring).  ``B`` / ``H``: ints >= 1, or ``None``
    (broadcast: 1).  ``BLOCK_SIZE``: an int (both sides) or ``(Q_BLOCK, KV_BLOCK)``, powers of 2
    >= 16."""
    aux = check_aux_tensors(aux_tensors)
    for i, a in enumerate(aux):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"aux_tensors[{i}]: create_block_mask evaluates the mask on the "
                            f"host: expected a NumPy array, got {type(a).__name__} (copy it to "
                            f"the host for this call)")
    check_mod("mask_mod", mask_mod, len(aux))
    if mask_mod is None:
        raise TypeError("mask_mod: expected a function, got None")
    B = 1 if B is None else _check_size("B", B)
    H = 1 if H is None else _check_size("H", H)
    Nq = _check_size("Nq", Nq)
    Nk = _check_size("Nk", Nk)
    if isinstance(BLOCK_SIZE, (tuple, list)):
        if len(BLOCK_SIZE) != 2:
            raise ValueError(f"BLOCK_SIZE: expected an int or (Q_BLOCK, KV_BLOCK), got "
                             f"{BLOCK_SIZE!r}")
        qb, kb = BLOCK_SIZE
    else:
        qb = kb = BLOCK_SIZE
    for nm, v in (("BLOCK_SIZE", qb), ("BLOCK_SIZE", kb)):
        v = _check_size(nm, v, 16)
        if v & (v - 1):
            raise ValueError(f"{nm}: expected powers of 2 >= 16, got {v}")
    qb, kb = int(qb), int(kb)

    from numba import typeof, types
    arg_types = (types.int64,) * 4 + tuple(typeof(a) for a in aux)
    host = check_host_types("mask_mod", mask_mod, arg_types, "bool", aux)
    kind = np.empty((B, H, -(-Nq // qb), -(-Nk // kb)), dtype=np.int8)
    try:
        _classifier()(host, B, H, Nq, Nk, qb, kb, aux, kind)
    except IndexError as exc:  # Numba's CPU bounds check: find the call again in Python
        calls = ((b, h, i, j) for b in range(B) for h in range(H) for i in range(Nq)
                 for j in range(Nk))
        found = locate_host_error("mask_mod", mask_mod, calls, aux)
        if found is not None:
            raise found from None
        raise IndexError(f"mask_mod {mask_mod.__name__}: an aux tensor index out of range "
                         f"({exc}; aux tensors: {describe_aux(mask_mod, 'mask_mod', aux)})"
                         ) from None
    return BlockMask(kind=kind, shape=(B, H, Nq, Nk), Q_BLOCK=qb, KV_BLOCK=kb, mask_mod=mask_mod,
                     aux_tensors=aux)
