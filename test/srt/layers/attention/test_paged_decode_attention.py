"""The torch_native paged decode ops (torch ops, and the float32 C++ operator) against a dense
reference (ragged lengths, GQA, pages), over a float32 cache and an int8 one (both ops write the
same int8 rows and read the same dequantized values)."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.layers import cpu_kernels
from airserve.srt.layers.attention.torch_native_backend import paged_decode_attention
from airserve.srt.mem_cache.memory_pool import kv_rows, kv_values


def cpp_op():
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    return torch.ops.airserve.paged_decode_attention_cpu.default


OPS = {"torch": lambda: paged_decode_attention, "cpp": cpp_op}

ATOL = 1e-5  # float32 on both sides


def reference(q, k_cache, v_cache, slots_per_row, scale):
    """Dense attention of each row over its own slots: [bs, H, D]."""
    outs = []
    group = q.shape[1] // k_cache.shape[1]
    for i, slots in enumerate(slots_per_row):
        keys = kv_values(k_cache[slots], q.dtype).repeat_interleave(group, dim=1)  # [n, H, D]
        values = kv_values(v_cache[slots], q.dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i], keys) * scale
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
    return torch.stack(outs)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["f32", "int8"])
@pytest.mark.parametrize("op", ["torch", "cpp"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("lens", [[7], [5, 40, 17], [1, 33]])
def test_matches_dense_reference_and_writes_only_out_cache_loc(op, page_size, lens, kv_dtype):
    check_against_reference(op, page_size, lens, heads=6, kv_heads=2, dim=16, scale=0.25,
                            kv_dtype=kv_dtype)


@pytest.mark.parametrize("op", ["torch", "cpp"])
@pytest.mark.parametrize("scale", [0.125, 3.0])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["f32", "int8"])
def test_model_sized_heads_and_long_rows(op, scale, kv_dtype):
    # The default model's head shape (9 query heads over 3 KV heads of 64) with rows longer than
    # the vector loops' width; scale 3 spreads the scores past e^-87 (the vector exp's floor).
    check_against_reference(op, 16, [300, 9, 64], heads=9, kv_heads=3, dim=64, scale=scale,
                            kv_dtype=kv_dtype)


def check_against_reference(op, page_size, lens, heads, kv_heads, dim, scale, kv_dtype):
    g = torch.Generator().manual_seed(0)
    width = max(64, max(lens))
    pages = (len(lens) * width) // page_size + len(lens) + 1
    max_blocks = -(-width // page_size)  # room for every row
    k_cache = kv_rows(torch.randn(pages * page_size, kv_heads, dim, generator=g), kv_dtype)
    v_cache = kv_rows(torch.randn(pages * page_size, kv_heads, dim, generator=g), kv_dtype)
    bs = len(lens)
    # Each row owns distinct pages (never page 0, the dummy page), padded with page 0.
    perm = (torch.randperm(pages - 1, generator=g) + 1).tolist()
    table = torch.zeros(bs, max_blocks, dtype=torch.int32)
    slots_per_row = []
    for i, n in enumerate(lens):
        blocks = -(-n // page_size)
        table[i, :blocks] = torch.tensor(perm[:blocks], dtype=torch.int32)
        perm = perm[blocks:]
        slots_per_row.append([int(table[i, t // page_size]) * page_size + t % page_size
                              for t in range(n)])
    q = torch.randn(bs, heads, dim, generator=g)
    k = torch.randn(bs, kv_heads, dim, generator=g)
    v = torch.randn(bs, kv_heads, dim, generator=g)
    loc = torch.tensor([s[-1] for s in slots_per_row])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k[loc], expected_v[loc] = kv_rows(k, kv_dtype), kv_rows(v, kv_dtype)
    out = OPS[op]()(q, k, v, k_cache, v_cache, loc, table,
                    torch.tensor(lens, dtype=torch.int32), page_size, scale)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    # A score's rounding grows with its size, so the bound does with the scale.
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, slots_per_row, scale),
                               atol=ATOL * max(1.0, scale), rtol=0)


def test_cpp_op_rejects_what_it_cannot_run():
    op = cpp_op()
    q, k = torch.randn(1, 4, 16), torch.randn(1, 2, 16)
    cache = torch.zeros(8, 2, 16)
    table, lens = torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    dtypes = "float32 queries, and a float32, bfloat16, float16 or int8 KV"
    with pytest.raises(RuntimeError, match=dtypes):
        op(q.bfloat16(), k, k, cache.bfloat16(), cache.bfloat16(), torch.tensor([1]), table,
           lens, 1, 0.25)
    with pytest.raises(RuntimeError, match=dtypes):
        op(q, k, k, cache.double(), cache.double(), torch.tensor([1]), table, lens, 1, 0.25)
    with pytest.raises(RuntimeError, match=dtypes):
        op(q, k, k, cache, cache.bfloat16(), torch.tensor([1]), table, lens, 1, 0.25)
    with pytest.raises(RuntimeError, match=dtypes):
        op(q, k, k, cache.half(), cache.bfloat16(), torch.tensor([1]), table, lens, 1, 0.25)
    # An int8 cache's head rows carry their scale: 16 + 4 bytes, not 16.
    with pytest.raises(RuntimeError, match="int8 cache's rows are D \\+ 4 bytes"):
        op(q, k, k, cache.to(torch.int8), cache.to(torch.int8), torch.tensor([1]), table, lens,
           1, 0.25)
    with pytest.raises(RuntimeError, match="does not fit the block table"):
        op(q, k, k, cache, cache.clone(), torch.tensor([1]), table, torch.tensor([3]), 1, 0.25)
    with pytest.raises(RuntimeError, match="out_cache_loc out of range"):
        op(q, k, k, cache, cache.clone(), torch.tensor([8]), table, lens, 1, 0.25)
