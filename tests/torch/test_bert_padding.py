"""unpad_input / pad_input with flash-attn's bert_padding semantics."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from numba_flash.torch import pad_input, unpad_input  # noqa: E402


def test_unpad_pad_round_trip_and_gradient():
    x = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3).requires_grad_()
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    packed, indices, cu, max_len, used = unpad_input(x, mask)
    assert torch.equal(indices, torch.tensor([0, 1, 4, 5, 6]))
    assert cu.dtype == torch.int32 and torch.equal(cu, torch.tensor([0, 2, 5], dtype=torch.int32))
    assert max_len == 3 and isinstance(max_len, int)
    assert torch.equal(used, torch.tensor([2, 3], dtype=torch.int32))
    assert torch.equal(packed, x.detach().reshape(8, 3)[indices])
    back = pad_input(packed, indices, 2, 4)
    assert torch.equal(back, x.detach() * mask[..., None])
    back.sum().backward()
    assert torch.equal(x.grad, mask[..., None].expand(2, 4, 3).float())


def test_unused_mask_is_packed_but_not_counted():
    x = torch.randn(1, 4, 2)
    mask = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
    unused = torch.tensor([[0, 0, 1, 0]], dtype=torch.bool)
    packed, indices, cu, max_len, used = unpad_input(x, mask, unused)
    assert torch.equal(indices, torch.tensor([0, 1, 2])) and max_len == 3
    assert cu.tolist() == [0, 3] and used.tolist() == [2]


def test_unpad_bad_mask():
    with pytest.raises(ValueError, match=r"attention_mask: expected a tensor of shape \(batch, "
                                         r"seqlen\) \(2, 4\)"):
        unpad_input(torch.randn(2, 4, 3), torch.ones(2, 5))
