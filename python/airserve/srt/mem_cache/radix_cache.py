"""Radix prefix cache: KV pages of finished (and retracted) requests, keyed by their token ids.

A node holds a run of tokens and the KV slots they were computed into; every key length is a
multiple of the page size, so a node owns whole pages of the paged pool and nothing else does
while it holds them. A running request locks the deepest node of its matched prefix (and so all
its ancestors); only unlocked leaves are evicted, least recently used first.

`NoPrefixCache` is the same interface with an empty tree (`--disable-radix-cache`): a request
owns all its pages and frees them when it ends.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from airserve.srt.mem_cache.memory_pool import PagedAllocator

_clock = itertools.count()  # access order; ties impossible, unlike wall-clock time


@dataclass(eq=False)
class TreeNode:
    key: list[int] = field(default_factory=list)  # token ids, len % page_size == 0
    value: torch.Tensor | None = None  # [len(key)] int64 KV slots of those tokens
    parent: TreeNode | None = None
    children: dict = field(default_factory=dict)  # first page of a child's key -> child
    lock_ref: int = 0  # running requests whose matched prefix passes through this node
    last_access: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.key)


@dataclass
class PrefixMatch:
    """The cached part of a token sequence: its length, KV slots and the node to lock."""

    length: int
    slots: torch.Tensor  # [length] int64
    node: TreeNode | None


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixCache:
    """Interface used by the scheduler: match / lock / unlock / insert / evict / reset."""

    enabled = True

    def __init__(self, allocator: PagedAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.stats = {"lookup_tokens": 0, "hit_tokens": 0, "evicted_tokens": 0,
                      "inserted_tokens": 0}
        self.reset()

    def reset(self) -> None:
        """Drop every node (their pages must have been returned, see `flush`)."""
        self.root = TreeNode(lock_ref=1)  # never evicted
        self.evictable_tokens = 0
        self.protected_tokens = 0
        self.num_nodes = 0

    def flush(self) -> None:
        """Free every page the tree holds; refused while a node is locked."""
        if self.protected_tokens:
            raise RuntimeError(f"{self.protected_tokens} cached tokens are in use by running "
                               "requests; flush when the server is idle")
        for node in self._nodes():
            self.allocator.free_slots(node.value)
        self.reset()

    # Size.
    @property
    def total_tokens(self) -> int:
        return self.evictable_tokens + self.protected_tokens

    def evictable_pages(self) -> int:
        return self.evictable_tokens // self.page_size

    def _key(self, tokens: list[int]):
        return tokens[0] if self.page_size == 1 else tuple(tokens[:self.page_size])

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    # Matching.
    def match_prefix(self, tokens: list[int], count: bool = True) -> PrefixMatch:
        """The longest cached, page-aligned prefix of `tokens`; splits a node where the match
        ends inside it, so the returned node covers exactly the match."""
        tokens = tokens[:self._aligned(len(tokens))]
        node, matched, pieces = self.root, 0, []
        now = next(_clock)
        node.last_access = now
        while matched < len(tokens):
            child = node.children.get(self._key(tokens[matched:]))
            if child is None:
                break
            n = self._aligned(_common_len(child.key, tokens[matched:]))
            if n < child.num_tokens:
                child = self._split(child, n)
            child.last_access = now
            pieces.append(child.value)
            matched += n
            node = child
        if count:
            self.stats["lookup_tokens"] += len(tokens)
            self.stats["hit_tokens"] += matched
        slots = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
        return PrefixMatch(matched, slots, node)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first n tokens; returns the new upper node."""
        top = TreeNode(key=child.key[:n], value=child.value[:n], parent=child.parent,
                       lock_ref=child.lock_ref, last_access=child.last_access)
        child.parent.children[self._key(child.key)] = top
        child.key, child.value = child.key[n:], child.value[n:]
        child.parent = top
        top.children[self._key(child.key)] = child
        self.num_nodes += 1
        return top

    # Inserting.
    def insert(self, tokens: list[int], slots: torch.Tensor) -> int:
        """Cache `slots` (the KV of `tokens`, page-aligned lengths) and return how many leading
        tokens were cached already: the caller still owns those slots and frees them."""
        assert len(tokens) == len(slots) and len(tokens) % self.page_size == 0
        node, done = self.root, 0
        now = next(_clock)
        while done < len(tokens):
            child = node.children.get(self._key(tokens[done:]))
            if child is None:
                leaf = TreeNode(key=list(tokens[done:]), value=slots[done:].clone(), parent=node,
                                last_access=now)
                node.children[self._key(leaf.key)] = leaf
                self.num_nodes += 1
                self.evictable_tokens += leaf.num_tokens
                self.stats["inserted_tokens"] += leaf.num_tokens
                return done
            n = self._aligned(_common_len(child.key, tokens[done:]))
            if n < child.num_tokens:
                child = self._split(child, n)
            child.last_access = now
            done += n
            node = child
        return done

    # Locks.
    def lock(self, node: TreeNode | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self.evictable_tokens -= node.num_tokens
                self.protected_tokens += node.num_tokens
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache node unlocked more often than locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_tokens += node.num_tokens
                self.protected_tokens -= node.num_tokens
            node = node.parent

    # Eviction.
    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages (if that many are evictable) from unlocked leaves,
        least recently used first. Returns the pages freed."""
        heap = [(n.last_access, id(n), n) for n in self._nodes()
                if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free_slots(leaf.value)
            freed += leaf.num_tokens // self.page_size
            self.evictable_tokens -= leaf.num_tokens
            self.stats["evicted_tokens"] += leaf.num_tokens
            self.num_nodes -= 1
            parent = leaf.parent
            del parent.children[self._key(leaf.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def cached_pages(self) -> list[int]:
        """Every page the tree holds (for audits and tests)."""
        p = self.page_size
        return [int(s) // p for node in self._nodes() for s in node.value[::p].tolist()]

    def report(self) -> dict:
        lookups = self.stats["lookup_tokens"]
        return {
            "enabled": self.enabled,
            "cached_tokens": self.total_tokens,
            "evictable_tokens": self.evictable_tokens,
            "nodes": self.num_nodes,
            "hit_rate": round(self.stats["hit_tokens"] / lookups, 4) if lookups else 0.0,
            **self.stats,
        }


class NoPrefixCache(RadixCache):
    """`--disable-radix-cache`: nothing is ever cached, so nothing matches or is evicted."""

    enabled = False

    def match_prefix(self, tokens: list[int], count: bool = True) -> PrefixMatch:
        if count:
            self.stats["lookup_tokens"] += self._aligned(len(tokens))
        return PrefixMatch(0, torch.empty(0, dtype=torch.int64), None)

    def insert(self, tokens: list[int], slots: torch.Tensor) -> int:
        self.allocator.free_slots(slots)  # the caller frees only what was cached already
        return 0
