"""The one argument convention for an attention variant's run-time data: :class:`Variant`.

Every attention kernel family (the SIMT and tensor-core forwards and backwards, decode) takes
its variant as one named tuple argument instead of positional tuples, so the kernels and their
launchers name each value (``va.scale``, ``va.window``) and a new variant is one new field.
What is compile time (softcap on or off, ALiBi, dropout, a user's functions) is in the kernel's
configuration; the values are here:

* ``scale``: the softmax scale, in the compute type;
* ``window``: ``(left, right)`` int32, causal folded in (``right = 0``), ``-1`` unbounded
  (:func:`~numba_flash.kernels.mainloop.visibility.window_bounds`);
* ``softcap``, ``inv_softcap``: the softcap and ``1 / softcap`` in the compute type (0 when off);
* ``alibi``: float32 ``[B, H]`` slopes (a ``[1, 1]`` zero array when off: never read);
* ``dropout``: ``()``, or ``(seed_lo, seed_hi, threshold, keep_scale)`` (three uint32 of
  :func:`numba_flash.philox.dropout_params` and ``1 / (1 - p)`` in the compute type);
* ``user``: ``()``, or ``(kinds,) + aux`` of a user's variant (:mod:`numba_flash.flex`):
  the block mask's int8 classification (read only with one) and the aux arrays;
* ``sink``: float32 ``[H]``, the learnable sink logits (natural units) the forward's epilogue
  adds to each row's denominator
  (:func:`~numba_flash.kernels.mainloop.online_softmax.make_epilogue`), or a zero-length array: no
  sink.

An empty tuple field costs the kernel no parameter and no instruction.
"""

from __future__ import annotations

import collections

from numba import types


class Variant(collections.namedtuple(
        "Variant", ["scale", "window", "softcap", "inv_softcap", "alibi", "dropout", "user",
                    "sink"])):
    """A kernel's variant data (the fields of the module docstring)."""

    __slots__ = ()


def variant_type(acc_t, dropout=False, user=()):
    """The Numba type of a :class:`Variant` for the compile tier: ``acc_t`` the compute type,
    ``dropout`` whether the dropout tuple is filled, ``user`` the Numba types of ``(kinds,) +
    aux`` (``()`` without a user variant)."""
    drop = (types.Tuple((types.uint32, types.uint32, types.uint32, acc_t)) if dropout
            else types.Tuple(()))
    return types.NamedTuple((acc_t, types.UniTuple(types.int32, 2), acc_t, acc_t,
                             types.Array(types.float32, 2, "C"), drop,
                             types.Tuple(tuple(user)), types.Array(types.float32, 1, "C")),
                            Variant)
