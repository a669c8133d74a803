"""The torch_native paged decode op against a dense reference (ragged lengths, GQA, pages)."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.layers.attention.torch_native_backend import paged_decode_attention

ATOL = 1e-5  # float32 on both sides


def reference(q, k_cache, v_cache, slots_per_row, scale):
    """Dense attention of each row over its own slots: [bs, H, D]."""
    outs = []
    group = q.shape[1] // k_cache.shape[1]
    for i, slots in enumerate(slots_per_row):
        keys = k_cache[slots].repeat_interleave(group, dim=1)  # [n, H, D]
        values = v_cache[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i], keys) * scale
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
    return torch.stack(outs)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("lens", [[7], [5, 40, 17], [1, 33]])
def test_matches_dense_reference_and_writes_only_out_cache_loc(page_size, lens):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 6, 2, 16
    pages, max_blocks = 160 // page_size + 1, -(-64 // page_size)  # room for every row
    k_cache = torch.randn(pages * page_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(pages * page_size, kv_heads, dim, generator=g)
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
    expected_k[loc], expected_v[loc] = k, v
    out = paged_decode_attention(q, k, v, k_cache, v_cache, loc, table,
                                 torch.tensor(lens, dtype=torch.int32), page_size, 0.25)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, slots_per_row, 0.25),
                               atol=ATOL, rtol=0)
