"""Every integer argument that reaches a kernel, fed too-large, negative, float, bool and uint64
values: the exception type (``ValueError`` for a value, ``TypeError`` for a type) comes before
any launch and the message starts with the argument's name (issue 21, item 4).  Too-large and
uint64 values are also shown as passed (never wrapped, never an OverflowError)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import numba_flash
from numba_flash.frontend.validate import check_int, check_int_array

U63 = 2**63  # the smallest uint64 that an int64 cannot hold


def _dense():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 3, 8)).astype(np.float32) for _ in range(3))
    return q, k, v


def _packed():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((6, 1, 8)).astype(np.float32) for _ in range(3))
    return dict(q=q, k=k, v=v, cu_seqlens_q=np.array([0, 2, 6], np.int32),
                cu_seqlens_k=np.array([0, 4, 6], np.int32), max_seqlen_q=4, max_seqlen_k=4)


def call_forward(**kw):
    q, k, v = _dense()
    return numba_flash.forward(q, k, v, dropout_p=0.5, **kw)


def call_backward(**kw):
    q, k, v = _dense()
    return numba_flash.backward(q, q, k, v, q, np.zeros((1, 1, 3), np.float32), dropout_p=0.5,
                                **kw)


def call_forward_varlen(**kw):
    a = dict(_packed(), **kw)
    return numba_flash.forward_varlen(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("cu_seqlens_q"),
                                      a.pop("cu_seqlens_k"), dropout_p=0.5, **a)


def call_backward_varlen(**kw):
    a = dict(_packed(), **kw)
    q = a.pop("q")
    return numba_flash.backward_varlen(q, q, a.pop("k"), a.pop("v"), q,
                                       np.zeros((1, 6), np.float32), a.pop("cu_seqlens_q"),
                                       a.pop("cu_seqlens_k"), dropout_p=0.5, **a)


def call_decode(**kw):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 8)).astype(np.float32)
    kc = rng.standard_normal((4, 1, 4, 8)).astype(np.float32)  # 4 blocks of 4 tokens
    a = dict(cache_seqlens=np.array([5, 8], np.int32),
             block_table=np.array([[2, 0], [1, 3]], np.int32))
    a.update(kw)
    return numba_flash.decode(q, kc, kc, **a)


def call_dropout_mask(**kw):
    a = dict(seed=1, B=1, H=1, Nq=2, Nk=2)
    a.update(kw)
    return numba_flash.dropout_mask(a["seed"], a["B"], a["H"], a["Nq"], a["Nk"], 0.5)


OPS = {"forward": call_forward, "backward": call_backward, "forward_varlen": call_forward_varlen,
       "backward_varlen": call_backward_varlen, "decode": call_decode,
       "dropout_mask": call_dropout_mask}


def array_cases(good):
    """Bad versions of an integer array ``good``: entry [0] (flat) replaced, or the dtype."""
    def put(value, dtype):
        a = np.array(good, dtype=dtype)
        a.flat[1 if a.size > 2 else 0] = value
        return a

    return {"too-large": (put(2**31, np.int64), ValueError, "2147483648"),
            "negative": (put(-1, np.int64), ValueError, "-1"),
            "float": (np.asarray(good, np.float64), TypeError, None),
            "bool": (np.asarray(good, bool), TypeError, None),
            "uint64": (put(U63, np.uint64), ValueError, str(U63))}


def scalar_cases(too_large, uint64=True):
    cases = {"too-large": (too_large, ValueError, str(too_large)),
             "negative": (-1, ValueError, "-1"),
             "float": (4.0, TypeError, None),
             "bool": (True, TypeError, None)}
    if uint64:
        cases["uint64"] = (np.uint64(U63), ValueError, str(U63))
    return cases


# (op, argument, its bad values); a seed is any uint64, so it has no bad uint64 value
ARGUMENTS = [
    *[(op, "seed", scalar_cases(2**64, uint64=False)) for op in OPS if op != "decode"],
    *[(op, name, array_cases(good)) for op in ("forward_varlen", "backward_varlen")
      for name, good in (("cu_seqlens_q", [0, 2, 6]), ("cu_seqlens_k", [0, 4, 6]))],
    *[(op, name, scalar_cases(2**31)) for op in ("forward_varlen", "backward_varlen")
      for name in ("max_seqlen_q", "max_seqlen_k")],
    ("decode", "cache_seqlens", array_cases([5, 8])),
    ("decode", "block_table", array_cases([[2, 0], [1, 3]])),
    ("decode", "num_splits", scalar_cases(2**31)),
    *[("dropout_mask", name, scalar_cases(2**32 + 1)) for name in ("B", "H", "Nq", "Nk")],
]
CASES = [pytest.param(op, name, *bad, id=f"{op}-{name}-{kind}")
         for op, name, cases in ARGUMENTS for kind, bad in cases.items()]


@pytest.mark.parametrize("op, name, value, exc, shown", CASES)
def test_integer_argument_is_checked_naming_it(op, name, value, exc, shown):
    with pytest.raises(exc, match=f"^{re.escape(name)}: ") as info:
        OPS[op](**{name: value})
    if shown is not None:  # the value as passed: not wrapped, not clipped
        assert re.search(rf"(?<![\d]){re.escape(shown)}(?![\d])", str(info.value)), info.value


def test_the_valid_extremes_are_accepted():
    """The bounds themselves pass: a uint64 seed of 2**64 - 1, num_splits 2**31 - 1."""
    assert call_forward(seed=np.uint64(2**64 - 1)).shape == (1, 1, 3, 8)
    assert call_decode(num_splits=2**31 - 1).shape == (2, 1, 8)


def test_helpers():
    assert check_int("n", np.uint64(7), 0, 10) == 7
    with pytest.raises(ValueError, match=r"^n: expected an int in \[0, 2\*\*31 - 1\], got "
                                         r"18446744073709551615$"):
        check_int("n", np.uint64(2**64 - 1), 0, 2**31 - 1)
    out = check_int_array("x", np.array([0, 2**31 - 1], np.uint64), 0, 2**31 - 1)
    assert out.dtype == np.int32 and out.tolist() == [0, 2**31 - 1]
    with pytest.raises(ValueError, match=r"^x: expected entries in \[0, 2\*\*31 - 1\], got -5 at "
                                         r"index \[1, 0\]$"):
        check_int_array("x", np.array([[1, 2], [-5, 3]], np.int8), 0, 2**31 - 1)
    with pytest.raises(ValueError, match=r"^x: expected entries in \[-2\*\*63, -2\], got 3 at "):
        check_int_array("x", np.array([3], np.uint8), -2**63, -2, np.int64)  # no uint8 fits
