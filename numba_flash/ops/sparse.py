"""Token-sparse attention's forward (issue 47): ``numba_flash.forward(..., kv_indices=)``.

Query token ``i`` of sequence ``b`` sees only the keys ``kv_indices[b, kvh or 0, i]`` lists
(:mod:`numba_flash.frontend.sparse`).  A query token's keys are its own, so the forward runs
as the token-sparse decode does (:func:`numba_flash.decode` with ``kv_indices``): ``k`` and
``v`` read as a contiguous cache of ``Nk`` keys per sequence, a block per query token whose
rows are the heads of one kv head (they share the list, as DSA's indexer and FlashMLA's sparse
prefill have it), the list split over blocks.  The key rows are gathered into registers, never
a dense tile: the work is ``O(Nq * topk)``, not ``O(Nq * Nk)``.  The story and its
machine-code count: docs/sparse-attention.md.
"""

from __future__ import annotations

import numpy as np

from ..frontend.validate import ATTENTION_DTYPES, array_module, check_qkv
from .decode import decode

#: forward's arguments a token-sparse call does not take, with the value that means "off"
_DENSE_ONLY = {"dropout_p": 0.0, "block_m": None, "block_n": None, "score_mod": None,
               "mask_mod": None, "block_mask": None, "aux_tensors": ()}


def sparse_forward(q, k, v, kv_indices, *, causal, softmax_scale, return_lse, window_size,
                   softcap, alibi_slopes, learnable_sink, kernel, **dense_only):
    """:func:`numba_flash.forward` with ``kv_indices`` (see there); ``dense_only``: the
    arguments of :data:`_DENSE_ONLY`, each a ``ValueError`` naming it when set."""
    for name, off in _DENSE_ONLY.items():
        given = dense_only.get(name, off)
        if not (given is off or (isinstance(off, (tuple, float)) and given == off)):
            raise ValueError(f"{name}: expected {off!r} with kv_indices (token-sparse attention "
                             f"runs the gathering decode kernel), got {given!r}")
    if kernel not in ("auto", "simt"):
        raise ValueError(f"kernel: expected 'auto' or 'simt' with kv_indices (the gather runs on "
                         f"the SIMT decode kernel), got {kernel!r}")
    s = check_qkv(q, k, v, dtypes=ATTENTION_DTYPES, value_dim=True)
    xp = array_module(q)
    lengths = xp.full((s.b,), s.nk, dtype=np.int32)   # every sequence: Nk keys
    return decode(q, k, v, cache_seqlens=lengths, causal=causal, softmax_scale=softmax_scale,
                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                  learnable_sink=learnable_sink, return_lse=return_lse, kv_indices=kv_indices,
                  kernel="simt")
