"""Issue 37, item 3: an error in a user's ``score_mod`` / ``mask_mod`` / ``score_mod_grad`` is
told in the user's terms: the function, its line, the arguments of the call and the aux tensor
with its shape; Numba's compile dump is cut to its first meaningful line and a hint; and
``NUMBA_FLASH_CHECK_AUX=1`` checks every aux read (the GPU has no bounds check), here in the
simulator and compiled for the CUDA target."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import numba_flash
from numba_flash.flex import create_block_mask

AUX = np.ones(8, np.float32)
HERE = os.path.basename(__file__)


@pytest.fixture
def qkv():
    rng = np.random.default_rng(37)
    return tuple(rng.standard_normal((1, 1, 8, 16)).astype(np.float32) for _ in range(3))


# -- the simulator runs the functions as Python: their exceptions, in their terms -----------------

def test_an_aux_index_out_of_range_names_the_function_and_the_tensor(qkv):
    """The issue's repro: a bare ``tid=[1, 0, 0] ctaid=[0, 0, 0]: index 100 is out of bounds``
    out of the launch before."""
    q, k, v = qkv
    with pytest.raises(IndexError) as e:
        numba_flash.forward(q, k, v, score_mod=lambda s, b, h, qi, ki, a: s + a[qi + 100],
                            aux_tensors=(AUX,))
    msg = str(e.value)
    assert msg.startswith(f"score_mod <lambda> ({HERE}:"), msg
    assert re.search(r"raised IndexError: index 10\d is out of bounds for axis 0 with size 8, "
                     r"at test_user_errors.py:\d+ `", msg) and "tid=" not in msg, msg
    assert "indexing a = aux_tensors[0] float32 (8,)" in msg
    assert "called with s=" in msg and ", b=0, h=0, qi=" in msg
    assert "NUMBA_FLASH_CHECK_AUX=1" in msg


def _mask_past(b, h, q_idx, kv_idx, doc):
    return doc[kv_idx + 8] > 0


def _grad_past(score, b, h, q_idx, kv_idx, a):
    return a[q_idx * 2]


def test_decode_and_backward_name_mask_mod_and_score_mod_grad(qkv):
    q, k, v = qkv
    with pytest.raises(IndexError, match=r"^mask_mod _mask_past \(.*indexing doc = aux_tensors"
                                         r"\[0\] float32 \(8,\)"):
        numba_flash.decode(q[:, :, 0], k, v, cache_seqlens=np.array([8], np.int32),
                           mask_mod=_mask_past, aux_tensors=(AUX,))
    o, lse = numba_flash.forward(q, k, v, return_lse=True)
    with pytest.raises(IndexError, match=r"^score_mod_grad _grad_past \(.*index \d+ is out of "
                                         r"bounds for axis 0 with size 8"):
        numba_flash.backward(q, q, k, v, o, lse, score_mod=lambda s, b, h, qi, ki, a: s,
                             score_mod_grad=_grad_past, aux_tensors=(AUX,))


def test_create_block_mask_checks_aux_bounds_on_the_host():
    """Numba's CPU code read past the array and classified garbage before."""
    doc = np.zeros(8, np.int32)
    with pytest.raises(IndexError) as e:
        create_block_mask(lambda b, h, q, k, doc: doc[q + 100] == doc[k], 1, 1, 64, 64,
                          aux_tensors=(doc,), BLOCK_SIZE=16)
    msg = str(e.value)
    assert msg.startswith("mask_mod <lambda> (") and "called with b=0, h=0, q=0, k=0" in msg
    assert "index 100 is out of bounds" in msg and "doc = aux_tensors[0] int32 (8,)" in msg


# -- Numba cannot compile it: the first meaningful line and a hint --------------------------------

TABLE = {1: 2.0}


def _uses_a_dict(s, b, h, q_idx, kv_idx):
    return s + TABLE[1]


def _three_indices(s, b, h, q_idx, kv_idx, a):
    return s + a[q_idx, kv_idx, 3]


@pytest.mark.parametrize("fn, aux, reason", [
    (_uses_a_dict, (), "Untyped global name 'TABLE': Cannot determine Numba type of <class "
                       "'dict'>"),
    (_three_indices, (AUX,), "cannot index array(float32, 1d, A) with 3 indices"),
])
def test_a_compile_error_is_its_first_meaningful_line_and_a_hint(qkv, monkeypatch, fn, aux,
                                                                  reason):
    monkeypatch.delenv("NUMBA_FLASH_DEBUG", raising=False)
    q, k, v = qkv
    with pytest.raises(TypeError) as e:
        numba_flash.forward(q, k, v, score_mod=fn, aux_tensors=aux)
    lines = str(e.value).splitlines()
    assert len(lines) == 2, lines  # was Numba's dump of 8 to 30 lines
    assert lines[0].startswith(f"score_mod: Numba could not compile {fn.__name__} ({HERE}:")
    assert reason in lines[0] and "`return s + " in lines[0], lines[0]
    assert lines[1].startswith("hint: a user function is compiled by Numba in nopython mode")
    monkeypatch.setenv("NUMBA_FLASH_DEBUG", "1")
    with pytest.raises(TypeError, match="(?s)Numba's message:\n.*During:"):
        numba_flash.forward(q, k, v, score_mod=fn, aux_tensors=aux)


# -- NUMBA_FLASH_CHECK_AUX=1: every aux read checked ----------------------------------------------

def _bias_sum(score, b, h, q_idx, kv_idx, bias):
    return score + bias[h, q_idx + kv_idx]


def _bias_diff(score, b, h, q_idx, kv_idx, bias):
    return score + bias[h, q_idx - kv_idx]  # down to -7: in range (counts from the end)


def test_check_aux_reports_the_read_the_index_and_the_call(qkv, monkeypatch):
    monkeypatch.setenv("NUMBA_FLASH_CHECK_AUX", "1")
    q, k, v = qkv
    bias = np.linspace(0, 1, 8, dtype=np.float32)[None]
    with pytest.raises(IndexError) as e:
        numba_flash.forward(q, k, v, score_mod=_bias_sum, aux_tensors=(bias,))
    msg = str(e.value)
    assert msg.startswith(f"score_mod _bias_sum ({HERE}:"), msg
    assert "aux read `bias[h, q_idx + kv_idx]` out of range: index " in msg
    assert "on axis 1 of size 8 (bias = aux_tensors[0] float32 (1, 8))" in msg
    assert "called with b=0, h=0, q_idx=" in msg
    o = numba_flash.forward(q, k, v, score_mod=_bias_diff, aux_tensors=(bias,))
    monkeypatch.delenv("NUMBA_FLASH_CHECK_AUX")
    np.testing.assert_array_equal(
        o, numba_flash.forward(q, k, v, score_mod=_bias_diff, aux_tensors=(bias,)))


def test_check_aux_in_a_lambda_mask_of_decode(qkv, monkeypatch):
    monkeypatch.setenv("NUMBA_FLASH_CHECK_AUX", "1")
    q, k, v = qkv
    with pytest.raises(IndexError, match=r"^mask_mod <lambda> .*aux read `d\[kv \+ 4\]` out of "
                                         r"range: index \d+ on axis 0 of size 8"):
        numba_flash.decode(q[:, :, 0], k, v, cache_seqlens=np.array([8], np.int32),
                           mask_mod=lambda b, h, qq, kv, d: d[kv + 4] > 0, aux_tensors=(AUX,))


def test_check_aux_without_source_warns_and_runs(qkv, monkeypatch):
    monkeypatch.setenv("NUMBA_FLASH_CHECK_AUX", "1")
    namespace = {}
    exec("def typed_at_a_prompt(s, b, h, q_idx, kv_idx, a):\n    return s + a[q_idx]\n",
         namespace)
    q, k, v = qkv
    with pytest.warns(UserWarning, match="cannot read the source of typed_at_a_prompt"):
        o = numba_flash.forward(q, k, v, score_mod=namespace["typed_at_a_prompt"],
                                aux_tensors=(AUX,))
    assert np.isfinite(o).all()


CUDA_SCRIPT = r"""
import os
os.environ["NUMBA_FLASH_CHECK_AUX"] = "1"
import numpy as np
from numba import cuda, float32, int32, types
from numba_flash.tools.compile_check import _device_functions_for
from numba_flash.flex.launch import prepare_variant

def bias_sum(score, b, h, q_idx, kv_idx, bias):
    return score + bias[h, q_idx + kv_idx]

variant = prepare_variant(score_mod=bias_sum, aux_tensors=(np.ones((2, 8), np.float32),))
score_mod = variant.score_mod

def kernel(out, aux):
    i = cuda.threadIdx.x
    out[i] = score_mod(float32(1.0), int32(0), int32(0), int32(i), int32(i), *aux)

aux_t = types.Tuple((types.Array(types.float32, 2, "A"), types.Array(types.int64, 1, "A")))
with _device_functions_for((8, 0)):
    ptx, _ = cuda.compile_ptx(kernel, (types.Array(types.float32, 1, "C"), aux_t), cc=(8, 0))
print("atom.global.cas.b64" in ptx)
"""


@pytest.mark.compile
def test_check_aux_compiles_for_the_cuda_target(tmp_path):
    """The checked reads are device code: PTX for sm_80, the guard's compare-and-swap in it
    (a script file: the check rewrites the function's source)."""
    script = tmp_path / "check_aux_cuda.py"
    script.write_text(CUDA_SCRIPT)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-W", "error::UserWarning", str(script)], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"


# -- found by the repeat of the bad-input sweep (2026-12-02) --------------------------------------

def _imports(s, b, h, q_idx, kv_idx):
    import math  # noqa: F401 - an import: bytecode Numba does not take
    return s


def test_unsupported_bytecode_is_the_named_compile_error(qkv):
    """Numba's ``UnsupportedBytecodeError`` (an import, ``global``, ``a, *r = ...``) derives
    from ``Exception`` alone: it used to escape raw, naming no argument."""
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"^score_mod: Numba could not compile _imports "
                                        r"\(.*IMPORT_NAME(?s:.*)\nhint: "):
        numba_flash.forward(q, k, v, score_mod=_imports)


@pytest.mark.parametrize("path, index", [("forward mma", "kv_idx"), ("forward wgmma", "q_idx"),
                                         ("decode", "b"), ("backward simt", "b"),
                                         ("backward mma", "q_idx")])
def test_an_integer_division_by_zero_raises_on_every_path(qkv, path, index):
    """``1 // (i - i)`` in a user function raises ``ZeroDivisionError`` naming the function on
    every kernel path: these paths pass some indices as NumPy integers, whose division by zero
    gave 0 and a warning (a result the function does not mean); a simulator launch now makes
    that warning an error (frontend.arrays.INT_DIVIDE_BY_ZERO)."""
    f = eval(f"lambda s, b, h, q_idx, kv_idx: s + 1 // ({index} - {index})")  # noqa: S307
    q, k, v = (x.astype(np.float16) if "simt" not in path else x for x in qkv)
    with pytest.raises(ZeroDivisionError, match=r"^score_mod <lambda> \("):
        if path.startswith("forward"):
            numba_flash.forward(q, k, v, score_mod=f, kernel=path.split()[1])
        elif path == "decode":
            numba_flash.decode(q[:, :, :1], k, v, cache_seqlens=np.array([8], np.int32),
                               score_mod=f)
        else:
            o, lse = numba_flash.forward(q, k, v, return_lse=True)
            numba_flash.backward(q, q, k, v, o, lse, score_mod=f,
                                 score_mod_grad=lambda s, b, h, q_idx, kv_idx: s * 0 + 1,
                                 kernel=path.split()[1])
