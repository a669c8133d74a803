"""Continuous batching over a paged KV cache.

One step: `batch = next_batch(); logits = model_runner.forward(batch.fb); process(batch, ...)`.
New requests are prefilled as soon as memory and limits allow and then join the decode batch.
When decode cannot grow, the newest running request is retracted (its KV freed) and re-run later
from its prompt plus the tokens it already produced, so its output is unchanged.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from airserve.srt.forward_batch import ForwardBatch, ForwardMode
from airserve.srt.managers.req import Req
from airserve.srt.model_executor.model_runner import ModelRunner
from airserve.srt.sampling.sampler import sample

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    reqs: list[Req]
    fb: ForwardBatch


class Scheduler:
    def __init__(self, model_runner: ModelRunner, eos_token_ids: tuple[int, ...],
                 max_prefill_tokens: int) -> None:
        self.runner = model_runner
        self.allocator = model_runner.allocator
        self.req_pool = model_runner.req_to_token_pool
        self.context_len = model_runner.context_len
        self.max_running = model_runner.max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._finished: list[Req] = []
        self.stats = {"prefill_tokens": 0, "generated_tokens": 0, "retractions": 0,
                      "finished_requests": 0, "aborted_requests": 0}

    # Requests in and out.
    def check_request(self, input_ids: list[int], max_new_tokens: int) -> None:
        """Raise ValueError if a request can never run here."""
        n = len(input_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give text or at least one input id")
        if n >= self.context_len:
            raise ValueError(
                f"the prompt has {n} tokens; the context length is {self.context_len} "
                "(the prompt plus at least one new token must fit)"
            )
        if self.allocator.pages_needed(0, n + 1) > self.allocator.total_usable_pages:
            raise ValueError(
                f"the prompt has {n} tokens but the KV cache holds "
                f"{self.allocator.total_usable_pages * self.allocator.page_size}; raise "
                "--max-total-tokens or --mem-fraction-static"
            )

    def add_request(self, req: Req) -> None:
        self.check_request(req.input_ids, req.sampling_params.max_new_tokens)
        if req.sampling_params.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
            return
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, {"type": "abort", "message": "aborted"})
                return True
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                self._release(req)
                self._finish(req, {"type": "abort", "message": "aborted"})
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished)

    def step(self) -> list[Req]:
        """Run one forward pass if there is work; return the requests that progressed."""
        batch = self.next_batch()
        updated: list[Req] = []
        if batch is not None:
            logits = self.runner.forward(batch.fb)
            updated = self.process(batch, logits)
        updated.extend(r for r in self._finished if r not in updated)
        self._finished = []
        return updated

    # Batch building.
    def next_batch(self) -> ScheduledBatch | None:
        prefill = self._admit()
        if prefill:
            return ScheduledBatch(prefill, self._build_extend(prefill))
        if not self.running:
            return None
        self._make_room_for_decode()
        if not self.running:
            return None
        return ScheduledBatch(list(self.running), self._build_decode(self.running))

    def _admit(self) -> list[Req]:
        admitted: list[Req] = []
        tokens = 0
        free_pages = self.allocator.available_pages()
        # Keep one page of headroom per running request so decode rarely has to retract.
        headroom = len(self.running)
        while self.waiting:
            req = self.waiting[0]
            n = len(req.fill_ids)
            pages = self.allocator.pages_needed(0, n)
            if len(self.running) + len(admitted) >= self.max_running:
                break
            if not self.req_pool.can_allocate(len(admitted) + 1):
                break
            if admitted and tokens + n > self.max_prefill_tokens:
                break
            if pages > free_pages - headroom - len(admitted):
                break
            self.waiting.popleft()
            admitted.append(req)
            tokens += n
            free_pages -= pages
        return admitted

    def _make_room_for_decode(self) -> None:
        def pages_needed() -> int:
            return sum(self.allocator.pages_needed(r.kv_len, r.kv_len + 1) for r in self.running)

        while self.running and pages_needed() > self.allocator.available_pages():
            if len(self.running) == 1:
                req = self.running.pop()
                self._release(req)
                logger.warning("request %s stopped: the KV cache is full with it alone", req.rid)
                self._finish(req, {"type": "abort", "message": "KV cache full; raise "
                                   "--max-total-tokens"})
                return
            victim = self.running.pop()  # the newest
            self._release(victim)
            victim.num_retractions += 1
            self.stats["retractions"] += 1
            self.waiting.appendleft(victim)
            logger.info("retracted request %s to free KV pages (%d running)", victim.rid,
                        len(self.running))

    def _build_extend(self, reqs: list[Req]) -> ForwardBatch:
        ids, positions, locs, lens, last = [], [], [], [], []
        for req in reqs:
            req.req_pool_idx = self.req_pool.allocate()
            fill = req.fill_ids
            locs.append(self.allocator.allocate(req.req_pool_idx, 0, len(fill)))
            ids.extend(fill)
            positions.extend(range(len(fill)))
            lens.append(len(fill))
            last.append(len(ids) - 1)
        self.stats["prefill_tokens"] += len(ids)
        return self.runner.make_forward_batch(
            ForwardMode.EXTEND, input_ids=ids, positions=positions,
            req_pool_indices=[r.req_pool_idx for r in reqs], seq_lens=lens,
            out_cache_loc=torch.cat(locs), extend_seq_lens=lens, extend_prefix_lens=[0] * len(reqs),
            last_token_indices=last,
        )

    def _build_decode(self, reqs: list[Req]) -> ForwardBatch:
        locs = [self.allocator.allocate(r.req_pool_idx, r.kv_len, r.kv_len + 1) for r in reqs]
        return self.runner.make_forward_batch(
            ForwardMode.DECODE, input_ids=[r.output_ids[-1] for r in reqs],
            positions=[r.kv_len for r in reqs], req_pool_indices=[r.req_pool_idx for r in reqs],
            seq_lens=[r.kv_len + 1 for r in reqs], out_cache_loc=torch.cat(locs),
        )

    # Results.
    def process(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[Req]:
        reqs = batch.reqs
        banned = [self.eos_token_ids if len(r.output_ids) < r.sampling_params.min_new_tokens
                  else () for r in reqs]
        next_ids = sample(logits, [r.sampling_params for r in reqs], [r.input_ids for r in reqs],
                          [r.output_ids for r in reqs], [r.generator for r in reqs], banned)
        now = time.perf_counter()
        for i, (req, token) in enumerate(zip(reqs, next_ids)):
            req.kv_len = batch.fb.seq_lens_cpu[i]
            req.output_ids.append(token)
            req.first_token_time = req.first_token_time or now
            self.stats["generated_tokens"] += 1
            reason = self._check_finished(req, token)
            if batch.fb.forward_mode.is_extend():
                self.running.append(req)
            if reason is not None:
                self.running.remove(req)
                self._release(req)
                self._finish(req, reason)
        return list(reqs)

    def _check_finished(self, req: Req, token: int) -> dict | None:
        params = req.sampling_params
        new_text = req.decoder.step(req.output_ids)
        if token in self.eos_token_ids and not params.ignore_eos:
            return {"type": "stop", "matched": token}
        if token in params.stop_token_ids:
            return {"type": "stop", "matched": token}
        if params.stop and new_text:
            window = req.decoder.text[-(len(new_text) + max(map(len, params.stop))):]
            for stop in params.stop:
                if stop in window:
                    return {"type": "stop", "matched": stop}
        if len(req.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        if req.seq_len >= self.context_len:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _release(self, req: Req) -> None:
        if req.req_pool_idx is not None:
            self.allocator.free(req.req_pool_idx, req.kv_len)
            self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_len = 0

    def _finish(self, req: Req, reason: dict) -> None:
        req.finished_reason = reason
        req.finished_time = time.perf_counter()
        req.decoder.flush(req.output_ids)
        key = "aborted_requests" if reason["type"] == "abort" else "finished_requests"
        self.stats[key] += 1
        self._finished.append(req)
