"""A request's KV pages over its life: shared prefix on admission, growth, release into the
prefix cache.

Every usable KV page is, at every moment between steps, exactly one of: free in the allocator,
held by the prefix cache (`RadixCache`), or owned by one request that has a request slot (its
positions [prefix_len, kv_len)). `audit()` checks that.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from airserve.srt.mem_cache.memory_pool import PagedAllocator, ReqToTokenPool
from airserve.srt.mem_cache.radix_cache import PrefixMatch, RadixCache

if TYPE_CHECKING:
    from airserve.srt.managers.req import Req


class KVManager:
    def __init__(self, allocator: PagedAllocator, req_pool: ReqToTokenPool,
                 cache: RadixCache) -> None:
        self.allocator = allocator
        self.req_pool = req_pool
        self.cache = cache
        self.page_size = allocator.page_size

    # Capacity.
    def available_pages(self) -> int:
        """Pages a request could get now: free ones plus those the cache could evict."""
        return self.allocator.available_pages() + self.cache.evictable_pages()

    def make_room(self, num_pages: int) -> bool:
        """Evict cached pages until `num_pages` are free; False if that is impossible."""
        short = num_pages - self.allocator.available_pages()
        if short > 0:
            self.cache.evict(short)
        return num_pages <= self.allocator.available_pages()

    # A request's life.
    def match(self, req: Req, count: bool = True) -> PrefixMatch:
        """The cached prefix a (re-)prefill of `req` can reuse; at least its last token is left
        to compute, since its logits give the next token; and none of the prompt positions
        whose logits the request still needs for prompt logprobs."""
        end = len(req.fill_ids) - 1
        need = req.prompt_logits_from
        return self.cache.match_prefix(req.fill_ids[:end if need is None else min(end, need)],
                                       count=count)

    def start(self, req: Req, match: PrefixMatch) -> None:
        """Give `req` a request slot whose first positions are the matched cached pages."""
        req.req_pool_idx = self.req_pool.allocate()
        self.allocator.assign(req.req_pool_idx, match.slots)
        self.cache.lock(match.node)
        req.last_node = match.node
        req.prefix_len = req.kv_len = req.kv_alloc_len = match.length
        req.cached_tokens += max(0, match.length - req.already_computed)

    def grow(self, req: Req, new_len: int) -> torch.Tensor:
        """KV slots for positions [kv_len, new_len) of `req` (after `make_room`)."""
        slots = self.allocator.allocate(req.req_pool_idx, req.kv_len, new_len)
        req.kv_alloc_len = max(req.kv_alloc_len, new_len)
        return slots

    def grow_decode(self, reqs: list[Req]) -> torch.Tensor:
        """The KV slot of each request's next position (after `make_room`), in one go."""
        slots = self.allocator.allocate_next([r.req_pool_idx for r in reqs],
                                             [r.kv_len for r in reqs])
        for req in reqs:
            req.kv_alloc_len = max(req.kv_alloc_len, req.kv_len + 1)
        return slots

    def pages_needed(self, req: Req, new_len: int) -> int:
        return self.allocator.pages_needed(req.kv_len, new_len)

    def share_prefix(self, req: Req) -> None:
        """Put `req`'s computed whole pages into the prefix cache while it runs (after each
        prefill step), so requests arriving meanwhile reuse them. Its row then points at the
        cached slots (its own duplicates are freed) and it locks the new deepest node."""
        whole = req.kv_len - req.kv_len % self.page_size
        if not self.cache.enabled or whole <= req.prefix_len:
            return
        tokens = req.fill_ids[:whole]
        slots = self.allocator.row_slots(req.req_pool_idx, 0, whole)
        cached_before = self.cache.insert(tokens, slots)
        if cached_before > req.prefix_len:
            self.allocator.free_slots(slots[req.prefix_len:cached_before])
        match = self.cache.match_prefix(tokens, count=False)
        assert match.length == whole
        self.allocator.assign(req.req_pool_idx, match.slots)
        self.cache.lock(match.node)
        self.cache.unlock(req.last_node)
        req.last_node = match.node
        req.prefix_len = whole

    def release(self, req: Req, cache: bool = True) -> None:
        """End `req`'s hold on KV: its computed tokens go into the prefix cache (whole pages),
        duplicates of what the cache has and the partial last page are freed. With
        `cache=False` (a failed request, whose KV may be half-written) its own pages are freed."""
        if req.req_pool_idx is None:
            return
        kv_len = req.kv_len
        end = max(kv_len, req.kv_alloc_len)  # slots of a step that never ran are freed too
        whole = kv_len - kv_len % self.page_size if cache else req.prefix_len
        slots = self.allocator.row_slots(req.req_pool_idx, 0, end)
        if cache:
            cached_before = self.cache.insert(req.fill_ids[:whole], slots[:whole])
            if cached_before > req.prefix_len:
                self.allocator.free_slots(slots[req.prefix_len:cached_before])
        if end > whole:
            self.allocator.free_slots(slots[whole:])
        self.cache.unlock(req.last_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        req.kv_len = req.prefix_len = req.kv_alloc_len = 0

    def flush(self) -> None:
        self.cache.flush()

    # Checks.
    def audit(self, holders: list[Req]) -> dict[str, int]:
        """Raise if any usable page is not exactly one of free / cached / owned by one of
        `holders` (the requests holding KV), or if a holder's shared prefix is not cached.
        Returns the page count of each kind."""
        p = self.page_size
        free = list(self.allocator._free_pages)
        cached = self.cache.cached_pages()
        owned: list[int] = []
        for req in holders:
            row = self.allocator.req_to_token[req.req_pool_idx]
            owned += (row[req.prefix_len:req.kv_len:p] // p).tolist()
            shared = set((row[:req.prefix_len:p] // p).tolist())
            if not shared <= set(cached):
                raise AssertionError(f"request {req.rid} shares pages the cache does not hold")
        everything = free + cached + owned
        if len(everything) != len(set(everything)):
            raise AssertionError("a KV page has two owners")
        if set(everything) != set(range(1, self.allocator.num_pages)):
            missing = set(range(1, self.allocator.num_pages)) - set(everything)
            raise AssertionError(f"KV pages leaked (no owner): {sorted(missing)[:10]}")
        return {"free": len(free), "cached": len(cached), "owned": len(owned)}
