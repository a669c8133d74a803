"""Which waiting requests prefill this step, and how much of each.

`SchedulePolicy` orders the queue (`--schedule-policy`): `fcfs` keeps arrival order, `lpm`
(longest prefix match) puts first the requests whose prompts the prefix cache already holds
most of, so requests sharing a prefix run together while it is cached.

`PrefillAdder` admits requests in that order while the step's token budget, the request slots
and the KV pages allow, and takes a prompt longer than what is left of the budget in chunks
(`--chunked-prefill-size`): the chunk's KV stays, the rest follows in the next steps.
`PrefillBudget` sets that budget: smaller while requests decode
(`--decode-chunked-prefill-size`), so new prompts do not stall running streams.
"""

from __future__ import annotations

from collections import deque

import torch

from airserve.srt.managers.req import Req
from airserve.srt.mem_cache.kv_manager import KVManager

POLICIES = ("fcfs", "lpm")
# Matching every waiting prompt each step costs time; past this queue length lpm orders by
# arrival (as SGLang does).
LPM_MAX_QUEUE = 128


class SchedulePolicy:
    def __init__(self, name: str, kv: KVManager) -> None:
        if name not in POLICIES:
            raise ValueError(f"--schedule-policy {name!r}: choose one of {', '.join(POLICIES)}")
        self.name = name
        self.kv = kv

    def order(self, waiting: deque[Req]) -> None:
        """Reorder `waiting` in place (stable: equal matches keep arrival order)."""
        if self.name == "fcfs" or len(waiting) > LPM_MAX_QUEUE or not self.kv.cache.enabled:
            return
        matched = {id(r): self.kv.match(r, count=False).length for r in waiting}
        ordered = sorted(waiting, key=lambda r: -matched[id(r)])
        waiting.clear()
        waiting.extend(ordered)


class PrefillAdder:
    """Collects one step's prefill rows. Each admitted request gets its KV slots at once, so
    the next candidate sees the pages that are really left; `locs[i]` are row i's slots."""

    def __init__(self, kv: KVManager, token_budget: int, chunked: bool, free_req_slots: int,
                 reserve_pages: int) -> None:
        self.kv = kv
        self.tokens_left = token_budget
        self.chunked = chunked  # may a prompt be cut at the budget?
        self.free_req_slots = free_req_slots
        self.reserve_pages = reserve_pages  # kept free for the running requests' decode
        self.reqs: list[Req] = []
        self.locs: list[torch.Tensor] = []
        self.partial: Req | None = None  # the request whose prompt continues next step

    def add_continuing(self, req: Req) -> bool:
        """The request whose earlier chunks are computed; False if no page is left for it."""
        take = min(len(req.fill_ids) - req.kv_len, self.tokens_left)
        pages = self.kv.pages_needed(req, req.kv_len + take)
        if take <= 0 or pages + self.reserve_pages > self.kv.available_pages():
            return False
        self.kv.make_room(pages)
        self._take(req, take)
        # It joins the running requests after its last chunk: its slot is one of this step's,
        # or max_running_requests would be exceeded by one (a decode batch of 33 under 32).
        self.free_req_slots -= 1
        return True

    def add(self, req: Req) -> bool:
        """Admit a waiting request (or part of its prompt); False when it must wait."""
        if self.partial is not None or self.tokens_left <= 0 or self.free_req_slots <= 0:
            return False
        if not self.kv.req_pool.can_allocate():
            return False
        match = self.kv.match(req, count=False)
        total = len(req.fill_ids)
        remaining = total - match.length
        if self.reqs and not self.chunked and remaining > self.tokens_left:
            return False
        # Its whole prompt must fit (not just the first chunk), besides the reserve.
        pages = self.kv.allocator.pages_needed(match.length, total)
        cache = self.kv.cache
        cache.lock(match.node)  # the matched pages are not evictable for this request
        fits = pages + self.reserve_pages <= self.kv.available_pages()
        cache.unlock(match.node)
        if not fits:
            return False
        match = self.kv.match(req)  # counted in the hit statistics once admitted
        self.kv.start(req, match)
        take = min(remaining, self.tokens_left) if self.chunked else remaining
        if not self.kv.make_room(self.kv.pages_needed(req, req.kv_len + take)):
            raise RuntimeError("KV pages vanished between the check and the allocation")
        self._take(req, take)
        self.free_req_slots -= 1
        self.reserve_pages += 1  # its own decode, once its prefill is done
        return True

    def _take(self, req: Req, take: int) -> None:
        req.extend_len = take
        self.locs.append(self.kv.grow(req, req.kv_len + take))
        self.reqs.append(req)
        self.tokens_left -= take
        if req.kv_len + take < len(req.fill_ids):
            self.partial = req


class PrefillBudget:
    """How many prompt tokens a prefill step may take, and whether one may run now.

    An idle server prefills up to `full` tokens per step (the chunk, or --max-prefill-tokens
    without chunking): TTFT is all that counts. While requests decode, every stream waits for
    each prefill step, so with `while_decoding` set (--decode-chunked-prefill-size) a step
    takes at most that many tokens and a decode step runs between two prefill steps: no stream
    waits for more than one bounded chunk. Unset, prefill steps run back to back whenever
    prefill work fits, as before.

    The budget holds while at least as many streams decode as prompts wait to start: a
    prefill step delays every stream by one step, a bounded one delays every waiting prompt's
    first token, so when the waiting prompts outnumber the streams (a wave of new requests, as
    at the start of a run at concurrency 64) prefill takes the full chunk. Under scattered
    arrivals, a few prompts against as many streams or more (one long prompt beside one
    stream included), the budget keeps streams smooth.
    """

    def __init__(self, full: int, while_decoding: int | None) -> None:
        self.full = full
        self.while_decoding = while_decoding
        self.last_was_prefill = False

    def limits(self, decoding: int, waiting: int) -> bool:
        """Whether the budget holds with `decoding` streams and `waiting` prompts."""
        return self.while_decoding is not None and decoding > 0 and decoding >= waiting

    def decode_first(self, decoding: int, waiting: int) -> bool:
        """True when the budget holds and the last step was a prefill: this step decodes."""
        return self.limits(decoding, waiting) and self.last_was_prefill

    def tokens(self, decoding: int, waiting: int) -> int:
        if self.limits(decoding, waiting):
            return min(self.full, self.while_decoding)
        return self.full
