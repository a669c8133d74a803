"""torch_native extend (prefill) attention: rows with a cached prefix read their keys from the
paged cache; rows without one run batched per length over the new keys. Both against a dense
reference, and the batched rows bit for bit against the per-row product they replace. Over an
int8 cache every path attends over the keys as the cache holds them (dequantized), so the
reference reads those too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from airserve.srt.forward_batch import ForwardBatch, ForwardMode, KVCache
from airserve.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from airserve.srt.mem_cache.memory_pool import (
    PagedAllocator,
    ReqToTokenPool,
    TokenToKVPool,
    kv_rows,
    kv_values,
)

HEADS, KV_HEADS, DIM, SCALE = 6, 2, 16, 0.25
ATOL = 1e-5  # float32 on both sides, different summation order


def make_batch(prefixes: list[int], news: list[int], page_size: int, seed: int = 0,
               kv_dtype: torch.dtype = torch.float32):
    """An extend batch whose row i has prefixes[i] cached tokens (their K/V already in the
    pool) and news[i] new ones. Returns (backend, fb, q, k, v, full_k, full_v): full_k[i] is
    row i's keys over its whole sequence [prefix + new, KVH, D]."""
    g = torch.Generator().manual_seed(seed)
    rows, width = len(news), max(p + n for p, n in zip(prefixes, news))
    req_pool = ReqToTokenPool(rows + 1, width + page_size, "cpu")
    pages = rows * (-(-width // page_size) + 1) + 2
    allocator = PagedAllocator(req_pool, pages, page_size)
    pool = TokenToKVPool(1, pages, page_size, KV_HEADS, DIM, kv_dtype, "cpu")
    backend = TorchNativeAttnBackend(allocator, width + page_size)
    slots, locs, full_k, full_v = [], [], [], []
    for p, n in zip(prefixes, news):
        slot = req_pool.allocate()
        slots.append(slot)
        kv = [torch.randn(p + n, KV_HEADS, DIM, generator=g) for _ in range(2)]
        full_k.append(kv[0])
        full_v.append(kv[1])
        cached = allocator.allocate(slot, 0, p)
        pool.k_buffers[0][cached] = kv_rows(kv[0][:p], kv_dtype)
        pool.v_buffers[0][cached] = kv_rows(kv[1][:p], kv_dtype)
        locs.append(allocator.allocate(slot, p, p + n))
    q = torch.randn(sum(news), HEADS, DIM, generator=g)
    k = torch.cat([t[p:] for t, p in zip(full_k, prefixes)])
    v = torch.cat([t[p:] for t, p in zip(full_v, prefixes)])
    total = sum(news)
    fb = ForwardBatch(
        ForwardMode.EXTEND, rows, torch.zeros(total, dtype=torch.long),
        torch.zeros(total, dtype=torch.long), torch.tensor(slots),
        torch.tensor([p + n for p, n in zip(prefixes, news)], dtype=torch.int32),
        [p + n for p, n in zip(prefixes, news)], torch.cat(locs),
        KVCache(pool.k_buffers, pool.v_buffers, page_size),
        extend_seq_lens_cpu=list(news), extend_prefix_lens_cpu=list(prefixes))
    backend.init_forward_metadata(fb)  # as the model runner does before each forward
    return backend, fb, q, k, v, full_k, full_v


def reference(q, full_k, full_v, prefixes, news) -> torch.Tensor:
    """Dense causal attention of each row's new tokens over its whole sequence: [T, H, D]."""
    group = HEADS // KV_HEADS
    outs, start = [], 0
    for keys, values, p, n in zip(full_k, full_v, prefixes, news):
        keys = keys.repeat_interleave(group, dim=1)  # [p + n, H, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q[start:start + n], keys) * SCALE
        visible = torch.arange(p + n)[None, :] <= torch.arange(n)[:, None] + p
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hts,shd->thd", scores.softmax(-1), values))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["f32", "int8"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("prefixes,news", [
    ([0, 0, 0], [8, 8, 8]),  # one batched product over adjacent rows
    ([0, 5, 0, 0], [7, 3, 7, 4]),  # equal fresh rows apart, a cached row between them
    ([9, 0, 17], [1, 33, 2]),  # prefix rows (one decode-like) beside a fresh one
    ([0], [1]),
])
def test_extend_matches_dense_reference_and_fills_cache(page_size, prefixes, news, kv_dtype):
    backend, fb, q, k, v, full_k, full_v = make_batch(prefixes, news, page_size,
                                                      kv_dtype=kv_dtype)
    out = backend.forward_extend(q, k, v, 0, SCALE, fb)
    held_k = [kv_values(kv_rows(t, kv_dtype), torch.float32) for t in full_k]
    held_v = [kv_values(kv_rows(t, kv_dtype), torch.float32) for t in full_v]
    torch.testing.assert_close(out, reference(q, held_k, held_v, prefixes, news),
                               atol=ATOL, rtol=0)
    # The new tokens' K/V are in the pool at their slots, as the cache holds them.
    assert torch.equal(fb.kv_cache.k_buffers[0][fb.out_cache_loc], kv_rows(k, kv_dtype))
    assert torch.equal(fb.kv_cache.v_buffers[0][fb.out_cache_loc], kv_rows(v, kv_dtype))


def test_batched_fresh_rows_equal_one_product_per_row():
    # Batching rows of one length must not change a bit of float32 output: the product per
    # row (what a lone request runs: the C++ operator where built, else torch's SDPA) is the
    # reference.
    news = [32, 32, 32, 32]
    backend, fb, q, k, v, _, _ = make_batch([0] * 4, news, 1, seed=3)
    out = backend.forward_extend(q, k, v, 0, SCALE, fb)
    for i in range(4):
        rows = slice(32 * i, 32 * (i + 1))
        if backend.cpp_built:
            alone = torch.empty_like(q[rows])
            torch.ops.airserve.prefill_attention_cpu(alone, q[rows], k[rows], v[rows], [0],
                                                     [0], [0], [32], SCALE)
        else:
            alone = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
                v[rows].transpose(0, 1)[None], is_causal=True, scale=SCALE,
                enable_gqa=True)[0].transpose(0, 1)
        assert torch.equal(out[rows], alone)
