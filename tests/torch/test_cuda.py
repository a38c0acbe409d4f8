"""numba_flash.torch on CUDA tensors (GPU only; skipped here without one): zero-copy CuPy views,
kernels on torch's current stream, results on the input's device."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numba_flash.torch as nft  # noqa: E402
from torch_helpers import attention_ref, check_rule  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    pytest.importorskip("cupy")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
def test_cuda_tensors_on_a_side_stream(cuda, dtype):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 128, 4, 64, generator=g).to(dtype) for _ in range(3))
    k, v = k[:, :, :2].contiguous(), v[:, :, :2].contiguous()  # GQA 4 / 2
    ref64, _ = attention_ref(q.double(), k.double(), v.double(), causal=True)
    refd, _ = attention_ref(q.float(), k.float(), v.float(), causal=True)
    side = torch.cuda.Stream(cuda)
    qd, kd, vd = (x.to(cuda).requires_grad_() for x in (q, k, v))
    torch.cuda.synchronize(cuda)
    with torch.cuda.stream(side):  # the kernels must run on this stream, ordered after it
        out = nft.flash_attn_func(qd, kd, vd, causal=True)
        out.float().square().sum().backward()
    side.synchronize()
    assert out.device == cuda and out.dtype == dtype and qd.grad.device == cuda
    floor = 1e-3 if dtype == torch.float16 else 1e-5
    check_rule(out.cpu(), ref64, refd.to(dtype), floor)
    assert torch.isfinite(qd.grad).all() and torch.isfinite(kd.grad).all()
