"""The int8 KV cache's rows (`kv_rows` / `kv_values`, the C++ `quantize_kv_cpu`): each
(token, head) row is its int8 values then its float32 scale, symmetric with scale = max|x| / 127
and round-to-nearest-even; checked byte for byte against the same arithmetic written in torch,
for the round trip's error bound, for a row of zeros, and for the error naming the fix where the
kernels cannot run."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.layers import cpu_kernels
from airserve.srt.mem_cache.memory_pool import (
    INT8_SCALE_BYTES,
    TokenToKVPool,
    kv_row_width,
    kv_rows,
    kv_values,
)


@pytest.fixture(autouse=True)
def built():
    if not cpu_kernels.available():
        pytest.fail(f"the C++ kernels did not build: {cpu_kernels.unavailable_reason()}")


def torch_rows(x: torch.Tensor) -> torch.Tensor:
    """The format in torch ops: float32 scale, values rounded half to even."""
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    values = torch.round(x * inv).clamp(-127, 127).to(torch.int8)
    scale = (amax / 127.0).contiguous().view(torch.int8)  # [..., 4] bytes
    return torch.cat([values, scale], dim=-1)


@pytest.mark.parametrize("shape", [(5, 2, 64), (33, 3, 128), (1, 1, 40)])
def test_rows_are_values_then_scale_as_torch_computes_them(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * torch.rand(shape[0], shape[1], 1, generator=g) * 8
    rows = kv_rows(x, torch.int8)
    assert rows.dtype == torch.int8 and rows.shape == shape[:-1] + (shape[-1] + 4,)
    assert torch.equal(rows, torch_rows(x))
    # Each value within half a step of its row's scale; the largest one is exact (+-127).
    back = kv_values(rows, torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert (back - x).abs().le(scale / 2 + 1e-7).all()
    assert rows[..., :shape[-1]].abs().amax(-1).eq(127).all()


def test_a_row_of_zeros_has_scale_zero_and_reads_back_zeros():
    x = torch.randn(3, 2, 16)
    x[1, 0] = 0
    rows = kv_rows(x, torch.int8)
    assert rows[1, 0].eq(0).all()  # the values and the 4 bytes of a float32 0.0
    assert kv_values(rows, torch.float32)[1, 0].eq(0).all()
    assert kv_values(rows, torch.float32)[1, 1].ne(0).any()


def test_pool_rows_carry_their_scale():
    assert kv_row_width(64, torch.int8) == 64 + INT8_SCALE_BYTES
    assert kv_row_width(64, torch.float16) == 64
    pool = TokenToKVPool(2, 4, 16, 3, 64, torch.int8, "cpu")
    assert pool.k_buffers[0].shape == (64, 3, 68) and pool.k_buffers[0].dtype == torch.int8
    # Bytes per token: 2 x layers x heads x (64 + 4), against 4 x 64 for float32.
    assert TokenToKVPool.bytes_per_token(2, 3, 64, torch.int8) == 2 * 2 * 3 * 68
    assert pool.memory_bytes() == 64 * TokenToKVPool.bytes_per_token(2, 3, 64, torch.int8)


def test_other_devices_are_refused_naming_the_fix():
    with pytest.raises(RuntimeError, match="needs airserve's C\\+\\+ CPU kernels.*float16"):
        kv_rows(torch.zeros(2, 1, 8, device="meta"), torch.int8)
    with pytest.raises(RuntimeError, match="must be \\[T, KVH, D\\]"):
        torch.ops.airserve.quantize_kv_cpu(torch.zeros(4, 8))
