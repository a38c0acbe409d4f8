"""numba_flash: readable FlashAttention kernels in Python with Numba CUDA.

The backend (GPU or the Numba CUDA simulator) is chosen on import, before ``numba.cuda`` is
first imported; :func:`backend` says which one runs.

Public API (the ops are imported on first use, so ``import numba_flash`` stays light):

* :func:`softmax` - row softmax with the online normaliser
* :func:`forward` - attention forward (causal, window, softcap, ALiBi, GQA, dropout, lse)
* :func:`forward_varlen` - the forward over a packed batch of variable-length sequences
* :func:`backward` - attention backward recomputed from lse
* :func:`backward_varlen` - the backward over a packed batch of variable-length sequences
* :func:`decode` - FlashDecoding split-KV decode over a contiguous or paged KV cache
* :func:`decode_plan` - the decode planned once per batch layout, run every step with no
  allocation or synchronisation (FlashInfer's plan / run; CUDA graphs)
* :class:`DecodePlan` - what :func:`decode_plan` returns: ``run(q, k_cache, v_cache, ...)``
* :func:`merge_states` - merge partial attention states with the log-sum-exp rule
* :func:`append_kv` - write new tokens' K/V into a contiguous or paged KV cache, in place
* :func:`apply_rotary` - rotary position embedding (flash-attn's ``apply_rotary_emb``)
* :func:`dropout_mask` - the exact keep-mask the kernels draw from a Philox seed
* :func:`quantize_e4m3` - e4m3 inputs and FA3's descales for the fp8 forward (host)
* :mod:`reference` - the float64 NumPy oracle
* :func:`backend` - ``"cuda"`` or ``"simulator"``: where the kernels run
* :func:`poisoned_outputs` - a context in which outputs start as NaN (for tests)
* :class:`MisalignedAddressError` - an access at an address its instruction cannot take (what
  a GPU reports as a misaligned address; the simulator raises it too)
* :class:`BackendError` - no backend can run kernels in this process
* :class:`SimulatorWarning` - kernels run in the simulator (no GPU found)
* :class:`SlowSimulatorWarning` - a simulator launch is estimated to take 30 s of CPU or more
"""

from .backend import (backend, BackendError, SimulatorWarning,  # noqa: F401  (must come first)
                      SlowSimulatorWarning)
from . import reference  # noqa: F401

if backend() == "simulator":
    from . import simulator as _simulator

    _simulator.install()  # thread-safe shared arrays in the simulator (see numba_flash.simulator)
from .frontend import poisoned_outputs  # noqa: F401

__version__ = "0.1.0"

_LAZY = {
    "softmax": "numba_flash.teach.ops.softmax",
    "forward": "numba_flash.ops.forward",
    "forward_varlen": "numba_flash.ops.forward_varlen",
    "backward": "numba_flash.ops.backward",
    "backward_varlen": "numba_flash.ops.backward_varlen",
    "decode": "numba_flash.ops.decode",
    "merge_states": "numba_flash.ops.decode",
    "decode_plan": "numba_flash.frontend.decode_plan",
    "DecodePlan": "numba_flash.frontend.decode_plan",
    "append_kv": "numba_flash.ops.kv_cache",
    "apply_rotary": "numba_flash.ops.rotary",
    "dropout_mask": "numba_flash.ops.dropout",
    "quantize_e4m3": "numba_flash.quantize",
    "MisalignedAddressError": "numba_flash.kernels.ptx.address",
}

__all__ = ["backend", "reference", "poisoned_outputs", "BackendError", "SimulatorWarning",
           "SlowSimulatorWarning", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'numba_flash' has no attribute {name!r}")


def __dir__():
    """The module's names with the public ops that are imported on first use."""
    return sorted(set(globals()) | set(__all__))
