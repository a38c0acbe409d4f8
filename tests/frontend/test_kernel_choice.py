"""kernel= (issue 21, item 8): one home for the choice, a broken tensor-core module is an error
naming its import failure (never a quiet fall-back to SIMT), and forward(kernel="mma") checks
each argument once.  No kernel runs here: launches are intercepted."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest

import numba_flash
import numba_flash.frontend.arrays as arrays
from numba_flash.ops import backward as backward_op
from numba_flash.ops import forward as forward_op


@pytest.fixture
def launches(monkeypatch):
    """Record the Python name of every kernel launched, launching nothing."""
    names = []

    def fake_launch(self, kernel, grid, block, *args, **kw):
        names.append(getattr(getattr(kernel, "py_func", None), "__name__", repr(kernel)))

    monkeypatch.setattr(arrays.ArrayCall, "launch", fake_launch)
    return names


class _Broken:
    """A meta-path finder that makes importing one module fail as a broken module would."""

    def __init__(self, fullname):
        self.fullname = fullname

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.fullname:
            raise ImportError("cannot import name 'mma_sync' from 'numba_flash.kernels.ptx.mma' "
                              "(boom-7391)")
        return None


def _break(monkeypatch, name):
    full = f"numba_flash.ops.{name}"
    importlib.import_module(full)  # so that monkeypatch puts the real module back afterwards
    monkeypatch.delitem(sys.modules, full)
    monkeypatch.delattr(numba_flash.ops, name)
    monkeypatch.setattr(sys, "meta_path", [_Broken(full), *sys.meta_path])


def _pretend_gpu(monkeypatch, cc=(9, 0)):
    """Make "auto" see a CUDA device of compute capability ``cc`` (on the code before and after
    the kernel choice moved to numba_flash.frontend.kernel_choice)."""
    monkeypatch.setattr(forward_op, "on_simulator", lambda: False, raising=False)
    monkeypatch.setattr(backward_op, "_cuda_cc", lambda: cc, raising=False)
    kc = sys.modules.get("numba_flash.frontend.kernel_choice")
    if kc is not None:
        monkeypatch.setattr(kc, "cuda_cc", lambda: cc)
    from numba import cuda

    class _Dev:
        compute_capability = cc

    monkeypatch.setattr(cuda, "get_current_device", lambda: _Dev(), raising=False)


def _qkv16():
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((1, 2, 4, 8)).astype(np.float16) for _ in range(3))


def test_broken_forward_mma_is_an_error_naming_the_import_failure(monkeypatch, launches):
    q, k, v = _qkv16()
    _pretend_gpu(monkeypatch)
    _break(monkeypatch, "forward_mma")
    with pytest.raises(ImportError, match=r"numba_flash\.ops\.forward_mma .*boom-7391"):
        numba_flash.forward(q, k, v)  # "auto", float16, compute capability 9.0
    with pytest.raises(ImportError, match=r"numba_flash\.ops\.forward_mma .*boom-7391"):
        numba_flash.forward(q, k, v, kernel="mma")
    assert launches == []  # no quiet fall-back to the SIMT kernel
    numba_flash.forward(q, k, v, kernel="simt")  # SIMT asked for: runs
    assert len(launches) == 1


def test_broken_backward_mma_is_an_error_naming_the_import_failure(monkeypatch, launches):
    q, k, v = _qkv16()
    o, do = q.copy(), q.copy()
    lse = np.zeros((1, 2, 4), np.float32)
    _pretend_gpu(monkeypatch)
    _break(monkeypatch, "backward_mma")
    for kernel in ("auto", "mma"):
        with pytest.raises(ImportError, match=r"numba_flash\.ops\.backward_mma .*boom-7391"):
            numba_flash.backward(do, q, k, v, o, lse, kernel=kernel)
    assert launches == []


def test_missing_mma_module_falls_back_or_says_so(monkeypatch):
    """A module that is not installed at all: "auto" takes SIMT, "mma" says what is missing."""
    from numba_flash.frontend import kernel_choice as kc

    real = importlib.import_module

    def missing(name, *args, **kw):
        if name.startswith("numba_flash.ops.") and name.endswith("_mma"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *args, **kw)

    monkeypatch.setattr(kc.importlib, "import_module", missing)
    monkeypatch.setattr(kc, "cuda_cc", lambda: (9, 0))
    assert kc.check_forward_kernel("auto", np.float16, False) == "simt"
    assert kc.check_backward_kernel("auto", np.float16) == "simt"
    with pytest.raises(NotImplementedError, match=r"^kernel: 'mma' needs numba_flash\.ops\."):
        kc.import_mma("forward_mma")


def test_one_home_for_the_kernel_choice():
    from numba_flash.frontend import kernel_choice as kc

    assert forward_op.KERNELS is kc.KERNELS
    for module in (forward_op, backward_op):
        for name in ("check_kernel", "_mma_available", "_cuda_cc"):
            assert not hasattr(module, name), f"{module.__name__}.{name}: a second copy"


def test_one_table_of_tensor_core_families():
    """kernel= is served by the families of one table (FAMILIES): each names its op module,
    the launch function there and what messages call it."""
    from numba_flash.frontend import kernel_choice as kc

    assert {(f.op, f.kernel): name for name, f in kc.FAMILIES.items()} == {
        ("forward", "mma"): "forward_mma", ("backward", "mma"): "backward_mma",
        ("forward", "wgmma"): "forward_wgmma"}
    for name, family in kc.FAMILIES.items():
        assert family.module == name
        assert callable(getattr(kc.import_mma(name), family.launch))


def test_a_call_imports_its_tensor_core_module_once(monkeypatch, launches):
    """"auto" on a (pretended) sm_90 and "mma" in bfloat16: the choice resolves the op module it
    picks once per call, and the launch uses that module."""
    from numba_flash.frontend import kernel_choice as kc
    from numba_flash.kernels.core.elements import BFLOAT16

    q, k, v = _qkv16()
    o, do = q.copy(), q.copy()
    lse = np.zeros(q.shape[:3], np.float32)
    _pretend_gpu(monkeypatch)
    seen = []
    real = importlib.import_module

    def counting(name, *args, **kw):
        if name.startswith("numba_flash.ops."):
            seen.append(name)
        return real(name, *args, **kw)

    monkeypatch.setattr(kc.importlib, "import_module", counting)
    numba_flash.forward(q, k, v)
    assert seen == ["numba_flash.ops.forward_mma"] and "mma" in launches[-1]
    seen.clear()
    numba_flash.forward(*(x.astype(BFLOAT16) for x in (q, k, v)), kernel="mma")
    assert seen == ["numba_flash.ops.forward_mma"]
    seen.clear()
    numba_flash.backward(do, q, k, v, o, lse)
    assert seen == ["numba_flash.ops.backward_mma"]


def _count_calls(monkeypatch, name, module_name):
    """Wrap every numba_flash module's binding of ``module_name.name`` in one call counter."""
    original = getattr(importlib.import_module(module_name), name)
    count = [0]

    def counted(*a, **kw):
        count[0] += 1
        return original(*a, **kw)

    for mod in list(sys.modules.values()):
        if (getattr(mod, "__name__", "").startswith("numba_flash")
                and getattr(mod, name, None) is original):
            monkeypatch.setattr(mod, name, counted)
    return count


def test_forward_on_tensor_cores_validates_once(monkeypatch, launches):
    """kernel="mma" (and "auto" where it picks tensor cores): each argument is checked once per
    call; the ALiBi slopes (a host synchronisation for CuPy slopes) are read once."""
    import numba_flash.ops.forward_mma  # noqa: F401  (bind its names before counting)

    q, k, v = _qkv16()
    slopes = np.ones(2, np.float32)
    qkv = _count_calls(monkeypatch, "check_qkv", "numba_flash.frontend.validate")
    alibi = _count_calls(monkeypatch, "check_alibi", "numba_flash.frontend.variants")
    numba_flash.forward(q, k, v, kernel="mma", causal=True, alibi_slopes=slopes, softcap=2.0)
    assert len(launches) == 1 and "mma" in launches[0], launches
    assert (qkv[0], alibi[0]) == (1, 1)
    _pretend_gpu(monkeypatch)
    numba_flash.forward(q, k, v, alibi_slopes=slopes)  # "auto" on a (pretended) sm_90
    assert len(launches) == 2 and "mma" in launches[1], launches
    assert (qkv[0], alibi[0]) == (2, 2)


def test_backward_on_tensor_cores_validates_once(monkeypatch, launches):
    """backward(kernel="mma"): the arrays and the ALiBi slopes are checked once per call (the
    tensor-core launches take the checked values), and the public backward_mma still checks."""
    import numba_flash.ops.backward_mma  # noqa: F401  (bind its names before counting)

    q, k, v = _qkv16()
    o, do = q.copy(), q.copy()
    lse = np.zeros(q.shape[:3], np.float32)
    slopes = np.ones(2, np.float32)
    arrays_ = _count_calls(monkeypatch, "check_backward_arrays", "numba_flash.frontend.validate")
    alibi = _count_calls(monkeypatch, "check_alibi", "numba_flash.frontend.variants")
    numba_flash.backward(do, q, k, v, o, lse, kernel="mma", causal=True, alibi_slopes=slopes)
    assert any("mma" in name for name in launches), launches
    assert (arrays_[0], alibi[0]) == (1, 1)
    numba_flash.ops.backward_mma.backward_mma(do, q, k, v, o, lse, alibi_slopes=slopes)
    assert (arrays_[0], alibi[0]) == (2, 2)
    with pytest.raises(TypeError, match="q: expected dtype float16"):
        numba_flash.ops.backward_mma.backward_mma(*(x.astype(np.float32) for x in
                                                    (do, q, k, v, o)), lse)


# -- bfloat16 (issue 23) ------------------------------------------------------------------------
def test_auto_takes_tensor_cores_for_bfloat16_on_sm80_and_simt_below(monkeypatch):
    """"auto": bfloat16 runs on the tensor cores from compute capability 8.0 (the bf16 mma and
    cvt.rn.bf16x2 are sm_80 instructions), on the SIMT kernels on an older GPU."""
    from numba_flash.kernels.core.elements import BFLOAT16
    from numba_flash.frontend import kernel_choice as kc

    monkeypatch.setattr(kc, "cuda_cc", lambda: (8, 0))
    assert kc.check_forward_kernel("auto", BFLOAT16, False) == "mma"
    assert kc.check_forward_kernel("auto", BFLOAT16, True) == "simt"  # explicit SIMT tiles
    monkeypatch.setattr(kc, "cuda_cc", lambda: (7, 5))
    assert kc.check_forward_kernel("auto", BFLOAT16, False) == "simt"
    assert kc.check_backward_kernel("auto", BFLOAT16) == "simt"
    for dtype in (BFLOAT16, np.float16):  # asked for on an sm_75: a clear error, no ptxas one
        with pytest.raises(ValueError, match=r"compute capability >= 8\.0 .*has 7\.5"):
            kc.check_forward_kernel("mma", dtype, False)
        with pytest.raises(ValueError, match=r"compute capability >= 8\.0 .*has 7\.5"):
            kc.check_backward_kernel("mma", dtype)
    monkeypatch.setattr(kc, "cuda_cc", lambda: None)  # the simulator runs the twins
    assert kc.check_forward_kernel("mma", BFLOAT16, False) == "mma"


def test_bfloat16_backward_reaches_the_tensor_cores_only_once_they_take_it(monkeypatch):
    """backward_mma's MMA_DTYPES says which dtypes it takes: without bfloat16 there, "auto" takes
    SIMT and "mma" is a ValueError naming the dtype; with it, both take the tensor cores."""
    import numba_flash.ops.backward_mma as bmma
    from numba_flash.kernels.core.elements import BFLOAT16
    from numba_flash.frontend import kernel_choice as kc

    monkeypatch.setattr(kc, "cuda_cc", lambda: (9, 0))
    monkeypatch.setattr(bmma, "MMA_DTYPES", ("float16",), raising=False)
    assert kc.check_backward_kernel("auto", BFLOAT16) == "simt"
    assert kc.check_backward_kernel("auto", np.float16) == "mma"
    with pytest.raises(ValueError, match="kernel: 'mma' .*does not take bfloat16 yet"):
        kc.check_backward_kernel("mma", BFLOAT16)
    monkeypatch.setattr(bmma, "MMA_DTYPES", ("float16", "bfloat16"))
    assert kc.check_backward_kernel("auto", BFLOAT16) == "mma"
    assert kc.check_backward_kernel("mma", BFLOAT16) == "mma"
    with pytest.raises(ValueError, match="float16 or bfloat16 inputs, got float32"):
        kc.check_backward_kernel("mma", np.float32)
