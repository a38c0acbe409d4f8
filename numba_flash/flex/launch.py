"""What an attention op does with a user's variant before any launch: :func:`prepare_variant`.

It checks every user argument (arity, that Numba compiles each function for the types the kernel
will call it with, the return kinds, the aux tensors, the block mask's shape and function) and
returns a :class:`UserVariant`: the CUDA device functions a kernel factory closes over, the aux
arrays to pass as one tuple argument, the block mask's classification, and ``key``, the hashable
identity of the compiled code (fingerprints, aux types) for the kernel factories' memoisation.

Inside a kernel, for a key ``kv_idx`` the query row ``q_idx`` may see (causal / window allow
it)::

    if MASK_MOD and not mask_mod(b, h, q_idx, kv_idx, *aux):   # skipped on a FULL block
        s = -inf
    elif SCORE_MOD:
        s = score_mod(s, b, h, q_idx, kv_idx, *aux)            # after scale, softcap, ALiBi

``b``, ``h``, ``q_idx``, ``kv_idx`` are int32 (the positions within the sequence) and ``s`` the
compute type (float32, float64 for float64 inputs).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .block_mask import BlockMask
from .errors import register
from .functions import check_aux_tensors, check_host_types, check_mod, device_function, fingerprint

__all__ = ["UserVariant", "prepare_variant", "aux_numba_types"]


class UserVariant(NamedTuple):
    score_mod: object       # CUDA device function or None
    mask_mod: object        # CUDA device function or None
    score_mod_grad: object  # CUDA device function or None
    aux: tuple              # the aux arrays, in order
    kinds: object           # int8 [B or 1, H or 1, q blocks, kv blocks] (block mask) or None
    block: tuple            # (Q_BLOCK, KV_BLOCK) of the block mask, or None
    key: tuple              # hashable identity of the compiled code


def aux_numba_types(aux):
    """The Numba types the kernels see for the aux arrays (any layout: checked on the host with
    ``"A"``)."""
    from numba import from_dtype, types
    return tuple(types.Array(from_dtype(np.dtype(a.dtype)), a.ndim, "A") for a in aux)


def prepare_variant(score_mod=None, mask_mod=None, aux_tensors=(), block_mask=None, *,
                    score_mod_grad=None, needs_grad=False, compute_dtype=np.float32,
                    shape=None, max_seqlens=None):
    """Check the user's variant arguments of an op; ``None`` when there are none.

    ``shape``: ``(B, H, Nq, Nk)`` of the op (for the block mask's check); ``needs_grad``: the op
    is a backward (a ``score_mod`` then needs ``score_mod_grad``).  A packed (varlen) batch
    passes ``B`` = its number of sequences, ``Nq`` / ``Nk`` its longest sequence's lengths and
    ``max_seqlens = (max_seqlen_q, max_seqlen_k)``: a block mask created for any ``Nq`` from the
    longest up to ``max_seqlen_q`` (``Nk`` likewise) fits, since the kernels index its blocks
    by the positions within a sequence and never past the longest one.
    """
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected a numba_flash.flex.BlockMask (from "
                        f"create_block_mask), got {type(block_mask).__name__}")
    if block_mask is not None:
        if mask_mod is None:
            mask_mod = block_mask.mask_mod
        elif fingerprint(mask_mod) != fingerprint(block_mask.mask_mod):
            raise ValueError("mask_mod: expected the function block_mask was created with (or "
                             "None), got a different one")
    if score_mod is None and mask_mod is None:
        if aux_tensors:
            raise ValueError("aux_tensors: given without a score_mod or mask_mod to use them")
        if score_mod_grad is not None:
            raise ValueError("score_mod_grad: given without a score_mod")
        return None
    aux = check_aux_tensors(aux_tensors)
    check_mod("score_mod", score_mod, len(aux))
    check_mod("mask_mod", mask_mod, len(aux))
    check_mod("score_mod_grad", score_mod_grad, len(aux))
    if score_mod_grad is not None and score_mod is None:
        raise ValueError("score_mod_grad: given without a score_mod")
    if needs_grad and score_mod is not None and score_mod_grad is None:
        raise ValueError(f"score_mod_grad: the backward of score_mod {score_mod.__name__} needs "
                         f"its derivative d score_mod / d score (a function of the same "
                         f"arguments), got None")

    from numba import from_dtype, types
    idx = (types.int32,) * 4
    aux_t = aux_numba_types(aux)
    acc = from_dtype(np.dtype(compute_dtype))
    for role, fn, types_, want in (("score_mod", score_mod, (acc,) + idx + aux_t, "float"),
                                   ("score_mod_grad", score_mod_grad, (acc,) + idx + aux_t,
                                    "float"),
                                   ("mask_mod", mask_mod, idx + aux_t, "bool")):
        if fn is not None:
            check_host_types(role, fn, types_, want, aux)
            register(role, fn)  # a simulator launch reports its exceptions by this name

    kinds = blk = None
    if block_mask is not None:
        if shape is not None:
            B, H, Nq, Nk = shape
            bB, bH, bNq, bNk = block_mask.shape
            if max_seqlens is None:
                fits = (bNq, bNk) == (Nq, Nk)
                what = "B and H may be 1"
            else:  # varlen: from the longest sequence's lengths up to max_seqlen_q / _k
                hq, hk = max(max_seqlens[0], Nq, 1), max(max_seqlens[1], Nk, 1)
                fits = Nq <= bNq <= hq and Nk <= bNk <= hk
                what = (f"packed batch: B the number of sequences, Nq in [{Nq}, {hq}] and Nk "
                        f"in [{Nk}, {hk}] (from the longest sequence's lengths to "
                        f"max_seqlen_q / max_seqlen_k); B and H may be 1")
            if bB not in (1, B) or bH not in (1, H) or not fits:
                raise ValueError(f"block_mask: expected a mask for [B, H, Nq, Nk] = "
                                 f"{list(shape)} ({what}), got one created for "
                                 f"{list(block_mask.shape)}")
        if len(block_mask.aux_tensors) != len(aux):
            raise ValueError(f"aux_tensors: block_mask was created with "
                             f"{len(block_mask.aux_tensors)} aux tensor(s), got {len(aux)}")
        kinds = block_mask.kind
        blk = (block_mask.Q_BLOCK, block_mask.KV_BLOCK)

    from . import aux_check

    check = aux_check.enabled()
    key = (fingerprint(score_mod) if score_mod is not None else None,
           fingerprint(mask_mod) if mask_mod is not None else None,
           fingerprint(score_mod_grad) if score_mod_grad is not None else None,
           tuple((np.dtype(a.dtype).str, a.ndim) for a in aux), block_mask is not None
           ) + (("aux checked",) if check else ())  # NUMBA_FLASH_CHECK_AUX=1: other code
    functions = {"score_mod": score_mod, "mask_mod": mask_mod, "score_mod_grad": score_mod_grad}
    if check:  # NUMBA_FLASH_CHECK_AUX=1: every aux read checked, the guard array last in aux
        functions, aux = aux_check.checked_variant(functions, aux)
    device = {role: device_function(fn) if fn is not None else None
              for role, fn in functions.items()}
    return UserVariant(score_mod=device["score_mod"], mask_mod=device["mask_mod"],
                       score_mod_grad=device["score_mod_grad"], aux=aux, kinds=kinds, block=blk,
                       key=key)
