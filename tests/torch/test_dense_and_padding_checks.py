"""Issue 37, item 4: sparse, nested, quantized and meta tensors are a TypeError naming the
argument before any conversion; ``pad_input`` / ``unpad_input`` check their indices, masks,
``batch`` and ``seqlen`` (a ValueError naming them), where torch's own errors named nothing or
the result was silently wrong."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from numba_flash.torch import (flash_attn_func, flash_attn_varlen_func,  # noqa: E402
                               pad_input, unpad_input)

Q = torch.ones(1, 4, 2, 8)
PACKED = torch.ones(4, 2, 8)
CU = torch.tensor([0, 4], dtype=torch.int32)

NOT_DENSE = {
    "sparse_coo": (lambda x: x.to_sparse(), "a sparse_coo tensor"),
    "sparse_csr": (lambda x: x.reshape(-1, x.shape[-1]).to_sparse_csr(), "a sparse_csr tensor"),
    "nested": (lambda x: torch.nested.nested_tensor(list(x)), "a nested tensor"),
    "jagged": (lambda x: torch.nested.nested_tensor(list(x), layout=torch.jagged),
               "a nested tensor"),
    "quantized": (lambda x: torch.quantize_per_tensor(x, 0.1, 0, torch.qint8),
                  "a quantized tensor (qint8)"),
    "meta": (lambda x: x.to("meta"), "a meta tensor"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: sparse CSR / nested are beta
@pytest.mark.parametrize("kind", list(NOT_DENSE))
@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_a_tensor_without_dense_values_is_a_type_error_naming_it(kind, arg):
    make, words = NOT_DENSE[kind]
    args = {"q": Q, "k": Q, "v": Q}
    args[arg] = make(Q.clone())
    with pytest.raises(TypeError, match=f"^{arg}: expected a dense \\(strided\\) tensor") as e:
        flash_attn_func(**args)
    assert words in str(e.value)


@pytest.mark.parametrize("kind", ["sparse_coo", "meta"])
def test_varlen_cu_seqlens_and_alibi_are_checked_too(kind):
    make = NOT_DENSE[kind][0]
    with pytest.raises(TypeError, match="^cu_seqlens_k: expected a dense"):
        flash_attn_varlen_func(PACKED, PACKED, PACKED, CU, make(CU), 4, 4)
    with pytest.raises(TypeError, match="^alibi_slopes: expected a dense"):
        flash_attn_func(Q, Q, Q, alibi_slopes=make(torch.ones(2)))


HS = torch.arange(18.0).reshape(6, 3)
PAD_CASES = {  # (indices, batch, seqlen) -> the error
    "index past the batch": ((torch.tensor([0, 1, 2, 3, 4, 100]), 2, 4),
                             (ValueError, r"^indices: expected entries in \[0, 8\) .* got 100")),
    "negative index": ((torch.tensor([0, 1, 2, 3, 4, -1]), 2, 4),
                       (ValueError, r"^indices: expected entries in \[0, 8\) .* got -1")),
    "repeated index": ((torch.tensor([0, 1, 2, 3, 4, 4]), 2, 4),
                       (ValueError, "^indices: expected distinct entries .* got 4 twice")),
    "float indices": ((torch.arange(6.0), 2, 4), (TypeError, "^indices: expected an integer")),
    "numpy indices": ((np.arange(6), 2, 4), (TypeError, "^indices: expected a torch.Tensor")),
    "short indices": ((torch.arange(5), 2, 4), (ValueError, r"^indices: expected shape \(6,\)")),
    "negative batch": ((torch.arange(6), -2, 4), (ValueError, "^batch: expected an int >= 1")),
    "zero seqlen": ((torch.arange(6), 2, 0), (ValueError, "^seqlen: expected an int >= 1")),
    "float batch": ((torch.arange(6), 2.0, 4), (TypeError, "^batch: expected an int >= 1")),
    "past int64": ((torch.arange(6), 2**62, 4),  # torch's OverflowError before
                   (ValueError, r"^seqlen: expected an int >= 1 \(batch \* seqlen at most")),
}


@pytest.mark.parametrize("case", list(PAD_CASES))
def test_pad_input_checks_indices_and_batch(case):
    (indices, batch, seqlen), (exc, msg) = PAD_CASES[case]
    with pytest.raises(exc, match=msg):
        pad_input(HS, indices, batch, seqlen)


def test_pad_input_still_pads():
    out = pad_input(HS, torch.tensor([0, 1, 2, 4, 5, 7]), 2, 4)
    assert out.shape == (2, 4, 3) and out[0, 3].eq(0).all() and torch.equal(out[1, 3], HS[5])


@pytest.mark.parametrize("mask, unused, msg", [
    (torch.full((2, 4), 2), None, r"^attention_mask: expected entries 0 or 1 .* got 2 at \[0, 0\]"),
    (torch.full((2, 4), 0.5), None, "^attention_mask: expected entries 0 or 1"),
    (torch.ones(2, 4), torch.eye(2, 4), r"^unused_mask: expected 0 where attention_mask is 1 .* "
                                        r"at \[0, 0\]"),
])
def test_unpad_input_masks_are_zeros_and_ones(mask, unused, msg):
    """A mask entry of 2 made cu_seqlens count a token twice that indices packed once."""
    with pytest.raises(ValueError, match=msg):
        unpad_input(torch.randn(2, 4, 3), mask, unused)


def test_unpad_input_names_a_sparse_hidden_states():
    with pytest.raises(TypeError, match="^hidden_states: expected a dense"):
        unpad_input(torch.randn(2, 4, 3).to_sparse(), torch.ones(2, 4))
