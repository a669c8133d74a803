"""Greedy sampling's argmax (csrc/argmax.cpp through sampler.greedy_tokens): the vector and the
plain loop against torch.max's indices on float32 and bfloat16 rows of many lengths (under 16,
tails after the 8-lane loop), ties (the first wins), NaN (the first NaN wins), infinities, and
its errors."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.layers import cpu_kernels
from airserve.srt.sampling.sampler import greedy_tokens


def ops():
    if not cpu_kernels.available():
        pytest.skip(f"C++ kernels not built: {cpu_kernels.unavailable_reason()}")
    return [torch.ops.airserve.argmax_rows, torch.ops.airserve.argmax_rows_portable]


def expected(logits: torch.Tensor) -> list[int]:
    return logits.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 7), (5, 16), (4, 17), (64, 49152),
                                        (9, 1000)])
def test_random_rows(dtype, rows, vocab):
    torch.manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab).to(dtype)
    for op in ops():
        assert op(logits).tolist() == expected(logits)
    assert greedy_tokens(logits) == expected(logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_nan_and_infinities(dtype):
    ops()
    vocab = 100
    rows = torch.randn(8, vocab)
    rows[0, [5, 40, 99]] = 7.0  # a tie: the first
    rows[1, [3, 77]] = float("nan")  # the first NaN, though 3.0 > others
    rows[1, 50] = 1e30
    rows[2] = float("-inf")  # every logit -inf: index 0
    rows[3, 90] = float("inf")
    rows[3, 95] = float("inf")
    rows[4, 0] = float("nan")
    rows[5] = 0.0  # all equal
    rows[6, 99] = 50.0  # in the scalar tail (100 = 12 x 8 + 4)
    rows[7, 98] = float("nan")  # a NaN in the tail only
    logits = rows.to(dtype)
    want = expected(logits)
    assert want[:8] == [5, 3, 0, 90, 0, 0, 99, 98]
    for op in ops():
        assert op(logits).tolist() == want


def test_non_contiguous_and_errors():
    op = ops()[0]
    logits = torch.randn(40, 6)[:, ::2]  # strided view
    assert op(logits).tolist() == expected(logits)
    with pytest.raises(RuntimeError, match=r"\[rows, vocab\]"):
        op(torch.randn(5))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.randn(2, 8).double())
    wide = torch.randn(3, 8).double()  # not the operator's: torch's max answers
    assert greedy_tokens(wide) == expected(wide)
