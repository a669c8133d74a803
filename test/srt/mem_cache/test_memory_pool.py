from __future__ import annotations

import random

import pytest
import torch

from airserve.srt.mem_cache.memory_pool import (
    DUMMY_PAGE,
    PagedAllocator,
    ReqToTokenPool,
    TokenToKVPool,
)


def make(num_pages: int, page: int, reqs: int = 8, ctx: int = 64):
    pool = ReqToTokenPool(reqs, ctx, "cpu")
    return pool, PagedAllocator(pool, num_pages, page)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_slots_follow_pages_and_never_touch_the_dummy_page(page):
    pool, alloc = make(num_pages=9, page=page, ctx=8 * page)
    slot = pool.allocate()
    locs = alloc.allocate(slot, 0, 3)
    locs = torch.cat([locs, alloc.allocate(slot, 3, 2 * page + 1)])
    assert locs.tolist() == pool.req_to_token[slot, : 2 * page + 1].tolist()
    pages = (locs // page).tolist()
    assert DUMMY_PAGE not in pages
    # Positions inside one page share it; consecutive positions are consecutive slots.
    assert all(locs[i + 1] == locs[i] + 1 for i in range(len(locs) - 1) if (i + 1) % page)
    assert alloc.available_pages() == 8 - 3
    table = alloc.block_table(torch.tensor([slot]), 8)
    assert table.shape == (1, 8) and table.dtype == torch.int32
    assert table[0, :3].tolist() == sorted(set(pages), key=pages.index)


def test_allocation_never_fails_from_fragmentation_while_pages_are_free():
    rng = random.Random(0)
    pool, alloc = make(num_pages=33, page=4, reqs=16, ctx=128)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and (rng.random() < 0.4 or not pool.can_allocate()):
            slot = rng.choice(list(live))
            alloc.free(slot, live.pop(slot))
            pool.free(slot)
            continue
        n = rng.randint(1, 30)
        if alloc.can_allocate(alloc.pages_needed(0, n)):
            slot = pool.allocate()
            alloc.allocate(slot, 0, n)
            live[slot] = n
        else:
            assert alloc.pages_needed(0, n) > alloc.available_pages()
    for slot, n in live.items():
        alloc.free(slot, n)
    assert alloc.available_pages() == 32


def test_double_free_and_overdraw_are_errors():
    pool, alloc = make(num_pages=3, page=2)
    slot = pool.allocate()
    with pytest.raises(RuntimeError, match="need 3 KV pages"):
        alloc.allocate(slot, 0, 6)
    pool.free(slot)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(slot)


def test_kv_pool_is_zeroed_and_sized():
    kv = TokenToKVPool(num_layers=2, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8,
                       dtype=torch.float32, device="cpu")
    assert len(kv.k_buffers) == 2 and kv.k_buffers[0].shape == (20, 2, 8)
    assert all(int(b.abs().sum()) == 0 for b in kv.k_buffers + kv.v_buffers)
    assert kv.memory_bytes() == 2 * 2 * 20 * 2 * 8 * 4
    assert TokenToKVPool.bytes_per_token(2, 2, 8, torch.float32) == 2 * 2 * 2 * 8 * 4
