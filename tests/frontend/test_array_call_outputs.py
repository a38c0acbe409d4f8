"""ArrayCall.result gives each output back in its own dtype even when Python reuses a freed
object's id: a bfloat16 intermediate (the rotated q of decode's fused append) freed before a
float32 output was allocated once made result() view that float32 lse as bfloat16 (a flaky
"cannot reshape array of size 32 into shape (2,4,2)" in test_decode_bfloat16's fused case)."""

from __future__ import annotations

import numpy as np

from numba_flash.frontend import ArrayCall
from numba_flash.kernels.core.elements import BFLOAT16


def test_a_freed_bfloat16_outputs_id_never_marks_a_later_output():
    call = ArrayCall({"q": np.zeros(2, np.float32)}, op="test")
    for _ in range(200):
        words = call.empty((4,), BFLOAT16)   # an intermediate, dropped after use
        del words
        out = call.empty((2, 2), np.float32)
        got = call.result(out)
        assert got.dtype == np.float32 and got.shape == (2, 2)
    bf = call.result(call.empty((3,), BFLOAT16))
    assert bf.dtype == BFLOAT16 and bf.shape == (3,)
