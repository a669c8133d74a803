"""The radix tree on its own: match, insert, split, lock and LRU eviction over a real allocator."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.mem_cache.memory_pool import PagedAllocator, ReqToTokenPool
from airserve.srt.mem_cache.radix_cache import NoPrefixCache, RadixCache


def make(page_size: int = 1, num_pages: int = 65):
    pool = ReqToTokenPool(4, 256, "cpu")
    alloc = PagedAllocator(pool, num_pages, page_size)
    return alloc, RadixCache(alloc)


def kv_for(alloc: PagedAllocator, n: int) -> torch.Tensor:
    """Fresh slots for n tokens, as a request would own them (allocated on request slot 0)."""
    return alloc.allocate(0, 0, n).clone()


def test_match_insert_and_split():
    alloc, cache = make()
    a = [1, 2, 3, 4, 5]
    slots_a = kv_for(alloc, 5)
    assert cache.insert(a, slots_a) == 0
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.length == 3 and m.slots.tolist() == slots_a[:3].tolist()
    assert cache.num_nodes == 2  # the match split [1..5] into [1,2,3] + [4,5]
    assert m.node.key == [1, 2, 3] and m.node.children[4].key == [4, 5]
    # A branch off the split point: only the new tail becomes a node.
    b = [1, 2, 3, 7, 8]
    slots_b = kv_for(alloc, 5)
    assert cache.insert(b, slots_b) == 3  # the caller still owns (and frees) slots_b[:3]
    assert cache.total_tokens == 7 and cache.num_nodes == 3
    assert cache.match_prefix(b).slots.tolist() == slots_a[:3].tolist() + slots_b[3:].tolist()
    assert cache.match_prefix([9, 9]).length == 0
    # Inserting an existing sequence adds nothing.
    assert cache.insert(a, slots_a) == 5 and cache.total_tokens == 7


def test_matching_is_page_aligned():
    alloc, cache = make(page_size=4)
    tokens = list(range(10, 22))  # 12 tokens, 3 pages
    slots = kv_for(alloc, 12)
    assert cache.insert(tokens, slots) == 0
    assert cache.match_prefix(tokens[:11]).length == 8  # 11 rounds down to 2 pages
    diverge = tokens[:6] + [99] * 6  # differs inside the second page: only page 1 matches
    m = cache.match_prefix(diverge)
    assert m.length == 4 and m.slots.tolist() == slots[:4].tolist()
    assert set(cache.cached_pages()) == set((slots[::4] // 4).tolist())
    with pytest.raises(AssertionError):
        cache.insert(tokens[:6], slots[:6])  # not whole pages


def test_lock_protects_from_eviction_and_lru_order():
    alloc, cache = make(num_pages=17)  # 16 usable slots
    old = [1, 1, 1, 1]
    new = [2, 2, 2, 2]
    locked = [3, 3, 3, 3]
    for key in (old, new, locked):
        cache.insert(key, kv_for(alloc, 4))
    node = cache.match_prefix(locked).node
    cache.lock(node)
    cache.match_prefix(new)  # touched after `old`
    assert cache.evictable_tokens == 8 and cache.protected_tokens == 4
    assert cache.evict(1) == 4  # the least recently used leaf, all of it
    assert cache.match_prefix(old).length == 0 and cache.match_prefix(new).length == 4
    assert cache.evict(100) == 4  # `new`; `locked` stays
    assert cache.match_prefix(locked).length == 4
    assert alloc.available_pages() == 4 + 8
    cache.unlock(node)
    assert cache.evict(100) == 4 and alloc.available_pages() == 16
    with pytest.raises(RuntimeError, match="unlocked more often"):
        cache.unlock(node)


def test_lock_covers_ancestors_and_inner_nodes_are_evicted_after_children():
    alloc, cache = make()
    cache.insert([1, 2, 3, 4], kv_for(alloc, 4))
    slots = kv_for(alloc, 4)
    assert cache.insert([1, 2, 5, 6], slots) == 2  # branch at 2; only the tail is new
    alloc.free_slots(slots[:2])  # the duplicate head stays the caller's to free
    leaf = cache.match_prefix([1, 2, 5, 6]).node
    cache.lock(leaf)
    assert cache.protected_tokens == 4  # the leaf [5, 6] and its parent [1, 2]
    assert cache.evict(100) == 2  # only the other leaf [3, 4]
    cache.unlock(leaf)
    assert cache.evict(100) == 4  # the leaf, then its now childless parent
    assert cache.total_tokens == 0 and cache.num_nodes == 0
    assert alloc.available_pages() == alloc.total_usable_pages


def test_flush_frees_everything_but_not_while_locked():
    alloc, cache = make()
    free_before = alloc.available_pages()
    cache.insert([5, 6, 7], kv_for(alloc, 3))
    node = cache.match_prefix([5, 6, 7]).node
    cache.lock(node)
    with pytest.raises(RuntimeError, match="in use"):
        cache.flush()
    cache.unlock(node)
    cache.flush()
    assert alloc.available_pages() == free_before and cache.total_tokens == 0


def test_hit_rate_and_disabled_cache():
    alloc, cache = make()
    cache.insert([1, 2, 3, 4], kv_for(alloc, 4))
    cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    report = cache.report()
    assert report["hit_rate"] == 0.5 and report["cached_tokens"] == 4
    off = NoPrefixCache(alloc)
    free = alloc.available_pages()
    off.insert([9, 9], kv_for(alloc, 2))  # frees instead of caching
    assert alloc.available_pages() == free and off.match_prefix([9, 9]).length == 0
    assert off.report()["enabled"] is False
