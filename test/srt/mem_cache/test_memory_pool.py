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


@pytest.mark.parametrize("page", [1, 4])
def test_allocate_next_gives_what_allocate_gives_per_request(page):
    """A decode step's slots in one call: the same pages, slots and table rows as one
    `allocate(slot, n, n + 1)` per request, in order, including rows that start a new page."""
    lens = [5, 8, 0, 3, 12]  # with page 4: positions 8, 0 and 12 open a new page
    results = []
    for batched in (False, True):
        pool, alloc = make(num_pages=40, page=page, reqs=8, ctx=32)
        slots = [pool.allocate() for _ in lens]
        for s, n in zip(slots, lens):
            if n:
                alloc.allocate(s, 0, n)
        if batched:
            locs = alloc.allocate_next(slots, lens)
        else:
            locs = torch.cat([alloc.allocate(s, n, n + 1) for s, n in zip(slots, lens)])
        assert locs.dtype == torch.int64
        results.append((locs.tolist(), pool.req_to_token.clone(), alloc.available_pages()))
    (locs_a, table_a, free_a), (locs_b, table_b, free_b) = results
    assert locs_a == locs_b
    assert torch.equal(table_a, table_b)
    assert free_a == free_b


def test_allocate_next_refuses_when_pages_run_out():
    pool, alloc = make(num_pages=3, page=1)
    slots = [pool.allocate() for _ in range(3)]
    with pytest.raises(RuntimeError, match="need 3 KV pages, 2 free"):
        alloc.allocate_next(slots, [0, 0, 0])
    assert alloc.available_pages() == 2  # nothing taken


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"),
                    reason="resident size is read from /proc")
def test_cpu_kv_pool_is_zero_and_resident_only_where_written():
    # 4 layers x K/V x 8192 slots x 2 heads x 256 x 4 bytes = 128 MiB of capacity.
    before = _resident_mib()
    kv = TokenToKVPool(4, 8192, 1, 2, 256, torch.float32, "cpu")
    assert kv.memory_bytes() == 128 * 2**20
    assert _resident_mib() - before < 32  # not written up front
    for buf in kv.k_buffers + kv.v_buffers:
        assert buf.shape == (8192, 2, 256) and buf.is_contiguous()
    kv.k_buffers[1][100:164] = 1.5
    kv.v_buffers[3][8000:] = -2.0
    assert kv.k_buffers[1].sum().item() == 1.5 * 64 * 512
    assert kv.v_buffers[3].sum().item() == -2.0 * 192 * 512
    # Every other value reads as zero, and the layers do not share memory.
    assert kv.k_buffers[0].abs().sum().item() == 0 and kv.v_buffers[1].abs().sum().item() == 0
