"""Continuous batching over a paged KV cache with a radix prefix cache.

One step: `batch = next_batch(); logits = model_runner.forward(batch.fb); process(batch, ...)`.
A new request reuses the KV of the longest cached prefix of its prompt and prefills the rest,
in chunks of --chunked-prefill-size tokens when it is long; after its last chunk it joins the
decode batch. While requests decode (at least as many as prompts wait), a prefill step takes at
most --decode-chunked-prefill-size tokens and a decode step runs between two prefill steps, so a
stream waits for one bounded chunk at most; with --enable-mixed-chunk the running requests
decode in the same forward as a prefill chunk. When decode cannot grow, cached pages are
evicted, then the newest running request is retracted (its KV goes into the prefix cache) and
re-run later from its prompt plus the tokens it already produced, so its output is unchanged.
A request with a grammar waits in the grammar queue until its grammar is compiled; its matcher
then masks every sampled token. A retracted request keeps its matcher: it re-reads the tokens
the matcher has accepted.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from airserve.srt.constrained.backend import GrammarBackend
from airserve.srt.forward_batch import ForwardBatch, ForwardMode
from airserve.srt.managers import isolation, logprob_rows
from airserve.srt.managers.grammar_queue import GrammarQueue
from airserve.srt.managers.req import Req
from airserve.srt.managers.schedule_policy import PrefillAdder, PrefillBudget, SchedulePolicy
from airserve.srt.managers.step_spans import StepSpans
from airserve.srt.mem_cache.kv_manager import KVManager
from airserve.srt.mem_cache.radix_cache import NoPrefixCache, RadixCache
from airserve.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.02  # an idle step waits this long for a compiling grammar


@dataclass
class ScheduledBatch:
    reqs: list[Req]  # prefill rows first, then the decode rows
    fb: ForwardBatch
    decode_rows: int = 0  # running requests that decode one token in this step


@dataclass(frozen=True)
class SchedulerConfig:
    max_prefill_tokens: int = 8192  # prefill tokens per step without chunking
    chunked_prefill_size: int | None = None  # None: whole prompts; else tokens per step
    # Prefill tokens per step while requests decode, a decode step between two prefill steps;
    # None: chunked_prefill_size, prefill steps back to back. Needs chunking.
    decode_chunked_prefill_size: int | None = None
    enable_mixed_chunk: bool = False
    schedule_policy: str = "fcfs"
    radix_cache: bool = True

    def __post_init__(self) -> None:
        budget = self.decode_chunked_prefill_size
        if budget is None:
            return
        if self.chunked_prefill_size is None:
            raise ValueError("decode_chunked_prefill_size needs chunked prefill: set "
                             "chunked_prefill_size (prompts are cut at the smaller budget)")
        if not 0 < budget <= self.chunked_prefill_size:
            raise ValueError(f"decode_chunked_prefill_size={budget}: must be in "
                             f"1..chunked_prefill_size ({self.chunked_prefill_size})")


class Scheduler:
    def __init__(self, model_runner: ModelRunner, eos_token_ids: tuple[int, ...],
                 config: SchedulerConfig | None = None,
                 grammar_backend: GrammarBackend | None = None) -> None:
        self.runner = model_runner
        self.config = config = config or SchedulerConfig()
        self.allocator = model_runner.allocator
        self.req_pool = model_runner.req_to_token_pool
        cache = (RadixCache if config.radix_cache else NoPrefixCache)(self.allocator)
        self.kv = KVManager(self.allocator, self.req_pool, cache)
        self.policy = SchedulePolicy(config.schedule_policy, self.kv)
        self.context_len = model_runner.context_len
        self.max_running = model_runner.max_running_requests
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Req] = deque()
        self.grammar_queue = GrammarQueue(grammar_backend)
        self.running: list[Req] = []
        self.chunked_req: Req | None = None  # prefilled in part; its next chunk comes first
        chunk = config.chunked_prefill_size
        self.budget = PrefillBudget(config.max_prefill_tokens if chunk is None else chunk,
                                    config.decode_chunked_prefill_size)
        self._finished: list[Req] = []
        self.stats = {"prefill_tokens": 0, "generated_tokens": 0, "retractions": 0,
                      "mixed_steps": 0, "finished_requests": 0, "aborted_requests": 0,
                      "failed_requests": 0, "grammar_requests": 0,
                      # Prefill steps the decode budget cut short; decode steps run between
                      # two prefill steps while prefill work waited.
                      "prefill_budget_limited_steps": 0, "interleaved_decode_steps": 0}
        self.spans = StepSpans()

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
        # A request never holds more than its prompt + outputs, nor more than the context.
        need = min(n + max(max_new_tokens, 1), self.context_len)
        if self.allocator.pages_needed(0, need) > self.allocator.total_usable_pages:
            pool = self.allocator.total_usable_pages * self.allocator.page_size
            raise ValueError(
                f"the prompt ({n} tokens) plus max_new_tokens ({max_new_tokens}) can never fit "
                f"the KV pool of {pool} tokens; raise --max-total-tokens (or "
                "--mem-fraction-static), or ask for fewer tokens"
            )

    def add_request(self, req: Req) -> None:
        self.check_request(req.input_ids, req.sampling_params.max_new_tokens)
        if req.sampling_params.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
            return
        if self.grammar_queue.needs_grammar(req):
            self.grammar_queue.add(req)
            self.stats["grammar_requests"] += 1
            return
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        compiling = self.grammar_queue.remove(rid)
        if compiling is not None:
            self._finish(compiling, {"type": "abort", "message": "aborted"})
            return True
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, {"type": "abort", "message": "aborted"})
                return True
        for req in self.running + [self.chunked_req]:
            if req is not None and req.rid == rid:
                if req is self.chunked_req:
                    self.chunked_req = None
                else:
                    self.running.remove(req)
                self.kv.release(req)
                self._finish(req, {"type": "abort", "message": "aborted"})
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req or self._finished
                    or self.grammar_queue)

    def holders(self) -> list[Req]:
        """The requests that hold KV pages now."""
        return self.running + ([self.chunked_req] if self.chunked_req is not None else [])

    def flush_cache(self) -> None:
        """Empty the prefix cache; refused while requests are in flight."""
        n = len(self.running) + len(self.waiting) + (self.chunked_req is not None) + len(
            self.grammar_queue)
        if n:
            raise RuntimeError(f"{n} requests are in flight; flush when the server is idle")
        self.kv.flush()

    def cache_report(self) -> dict:
        return self.kv.cache.report()

    def step(self) -> list[Req]:
        """Run one forward pass if there is work; return the requests that progressed."""
        self._admit_compiled()
        t0 = time.perf_counter()
        batch = self.next_batch()
        updated: list[Req] = []
        if batch is not None:
            t1 = time.perf_counter()
            rows, logits = isolation.forward_isolated(self, batch)
            t2 = time.perf_counter()
            updated = self.process(batch, logits, rows)
            prefill = batch.reqs[:len(batch.reqs) - batch.decode_rows]
            self.spans.record(batch.decode_rows, len(prefill), sum(r.extend_len for r in prefill),
                              t1 - t0, t2 - t1, time.perf_counter() - t2)
        updated.extend(r for r in self._finished if r not in updated)
        self._finished = []
        return updated

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the waiting queue; failed ones end (400). With
        nothing else to run, wait a little for a grammar rather than spin."""
        queue = self.grammar_queue
        if not queue:
            return
        if not (self.waiting or self.running or self.chunked_req):
            queue.wait(GRAMMAR_WAIT_S)
        ready, failed = queue.pop_done()
        self.waiting.extend(ready)
        for req, error in failed:
            self.stats["failed_requests"] += 1
            self._finish(req, {"type": "abort", "status_code": isolation.status_for(error),
                               "message": str(error)})

    # Batch building.
    def next_batch(self) -> ScheduledBatch | None:
        """Without mixed batches: a prefill step whenever prefill work fits, else a decode step;
        with a decode budget, never two prefill steps in a row while requests decode. With
        them (--enable-mixed-chunk): the running requests' decode rows ride along with this
        step's prefill rows in one extend batch."""
        if self.config.enable_mixed_chunk and self.running:
            return self._next_mixed()
        if self.budget.decode_first(len(self.running), self.num_waiting()) and (
                self.waiting or self.chunked_req):
            batch = self._decode_batch()
            if batch is not None:  # None: every stream was retracted to make room
                self.stats["interleaved_decode_steps"] += 1
                self.budget.last_was_prefill = False
                return batch
        prefill = self._admit()
        self.budget.last_was_prefill = prefill is not None
        if prefill is not None:
            return ScheduledBatch(prefill.reqs, self._build_extend(prefill.reqs, prefill.locs))
        return self._decode_batch()

    def _next_mixed(self) -> ScheduledBatch | None:
        retracted = self._make_room_for_decode()
        # Re-admitting a request retracted this very step would only thrash.
        prefill = None if retracted else self._admit()
        if prefill is None:
            return self._decode_batch(room_made=True)
        return self._mixed_batch(prefill)

    def _admit(self) -> PrefillAdder | None:
        """This step's prefill rows, their KV slots allocated; None if nothing can start."""
        chunked = self.config.chunked_prefill_size is not None
        budget = self.budget.tokens(len(self.running), self.num_waiting())
        adder = PrefillAdder(self.kv, budget, chunked, self.max_running - len(self.running),
                             reserve_pages=len(self.running))
        if self.chunked_req is not None and not adder.add_continuing(self.chunked_req):
            return None
        self.policy.order(self.waiting)
        while self.waiting and adder.add(self.waiting[0]):
            self.waiting.popleft()
        self.chunked_req = adder.partial
        if not adder.reqs:
            return None
        taken = sum(r.extend_len for r in adder.reqs)
        if budget < self.budget.full and taken >= budget and (self.chunked_req or self.waiting):
            self.stats["prefill_budget_limited_steps"] += 1
        self.stats["prefill_tokens"] += taken
        return adder

    def num_waiting(self) -> int:
        """Prompts waiting to start or to finish their prefill."""
        return len(self.waiting) + (self.chunked_req is not None)

    def _decode_batch(self, room_made: bool = False) -> ScheduledBatch | None:
        if not room_made:
            self._make_room_for_decode()
        if not self.running:
            return None
        for req in self.running:
            req.extend_len = 1
        return ScheduledBatch(list(self.running), self._build_decode(self.running),
                              decode_rows=len(self.running))

    def _mixed_batch(self, prefill: PrefillAdder) -> ScheduledBatch:
        """Prefill rows, then every running request as a one-token extend. Eager by nature (the
        decode graphs take decode batches only), and not an eager fallback."""
        locs = list(prefill.locs)
        # The admission kept one page per running request in reserve.
        if not self.kv.make_room(sum(self.kv.pages_needed(r, r.kv_len + 1) for r in self.running)):
            raise RuntimeError("no KV pages left for the decode rows of a mixed batch")
        for req in self.running:
            req.extend_len = 1
            locs.append(self.kv.grow(req, req.kv_len + 1))
        reqs = prefill.reqs + self.running
        self.stats["mixed_steps"] += 1
        return ScheduledBatch(reqs, self._build_extend(reqs, locs), decode_rows=len(self.running))

    def _make_room_for_decode(self) -> bool:
        """Free pages for one more token of every running request: evict cached pages first,
        then retract the newest requests. True if any request was retracted."""
        def pages_needed() -> int:
            return sum(self.kv.pages_needed(r, r.kv_len + 1) for r in self.running)

        retracted = False
        while self.running and not self.kv.make_room(pages_needed()):
            retracted = True
            if self.chunked_req is not None:  # a half-read prompt yields before any stream
                victim, self.chunked_req = self.chunked_req, None
            elif len(self.running) == 1:
                req = self.running.pop()
                self.kv.release(req)
                logger.warning("request %s stopped: the KV cache is full with it alone", req.rid)
                self._finish(req, {"type": "abort", "message": "KV cache full; raise "
                                   "--max-total-tokens"})
                return True
            else:
                victim = self.running.pop()  # the newest
            self.kv.release(victim)  # its KV goes into the prefix cache: a re-run reuses it
            victim.num_retractions += 1
            self.stats["retractions"] += 1
            self.waiting.appendleft(victim)
            logger.info("retracted request %s to free KV pages (%d running)", victim.rid,
                        len(self.running))
        return retracted

    def _build_extend(self, reqs: list[Req], locs: list[torch.Tensor]) -> ForwardBatch:
        """One extend batch: row i adds reqs[i].extend_len tokens after its kv_len cached ones
        (a prompt chunk, or a decode row's last output token)."""
        ids, positions, lens, prefix_lens, last = [], [], [], [], []
        for req in reqs:
            start, n = req.kv_len, req.extend_len
            prompt_len = len(req.input_ids)
            if start >= prompt_len:  # a decode row: no need to copy the whole sequence
                ids.extend(req.output_ids[start - prompt_len:start - prompt_len + n])
            else:
                ids.extend(req.fill_ids[start:start + n])
            positions.extend(range(start, start + n))
            prefix_lens.append(start)
            lens.append(n)
            last.append(len(ids) - 1)
        rows, counts = logprob_rows.logit_rows(reqs, prefix_lens, lens) or (None, None)
        return self.runner.make_forward_batch(
            ForwardMode.EXTEND, input_ids=ids, positions=positions,
            req_pool_indices=[r.req_pool_idx for r in reqs],
            seq_lens=[p + n for p, n in zip(prefix_lens, lens)], out_cache_loc=torch.cat(locs),
            extend_seq_lens=lens, extend_prefix_lens=prefix_lens, last_token_indices=last,
            logit_rows=rows, logit_counts=counts,
        )

    def _build_decode(self, reqs: list[Req]) -> ForwardBatch:
        positions = [r.kv_len for r in reqs]
        return self.runner.make_forward_batch(
            ForwardMode.DECODE, input_ids=[r.output_ids[-1] for r in reqs],
            positions=positions, req_pool_indices=[r.req_pool_idx for r in reqs],
            seq_lens=[n + 1 for n in positions], out_cache_loc=self.kv.grow_decode(reqs),
        )

    # Results.
    def process(self, batch: ScheduledBatch, logits: torch.Tensor,
                rows: list[int] | None = None) -> list[Req]:
        """`logits` are those of the batch's `rows` that ran (all by default). Sample a token
        for every row that finished its prompt or decoded; a row that read a prompt chunk only
        keeps its KV. A request whose sampling or bookkeeping raises fails alone. Returns the
        requests that progressed."""
        rows = list(range(len(batch.reqs))) if rows is None else rows
        seq_lens = batch.fb.seq_lens_cpu
        if batch.fb.logit_counts_cpu is not None:  # some rows brought prompt logits
            fb = batch.fb
            logits = logprob_rows.split_logits(
                [batch.reqs[i] for i in rows], [fb.extend_prefix_lens_cpu[i] for i in rows],
                [fb.extend_seq_lens_cpu[i] for i in rows],
                [fb.logit_counts_cpu[i] for i in rows], logits)
        done, picked = [], []  # batch rows that produce a token; their rows in `logits`
        running = set(map(id, self.running))
        for k, i in enumerate(rows):
            req = batch.reqs[i]
            req.kv_len = seq_lens[i]
            req.already_computed = max(req.already_computed, req.kv_len)
            if id(req) not in running:  # a prefill row: later prompts may share its prefix
                self.kv.share_prefix(req)
            if req.kv_len == req.seq_len:
                done.append(i)
                picked.append(k)
        reqs = [batch.reqs[i] for i in done]
        if not reqs:
            return []
        if len(picked) < logits.shape[0]:
            logits = logits[picked]
        next_ids = isolation.sample_isolated(self, reqs, logits, [seq_lens[i] for i in done])
        logprob_rows.record_output_logprobs(reqs, logits, next_ids)
        now = time.perf_counter()
        for i, req, token in zip(done, reqs, next_ids):
            if token is None:  # failed while sampling
                continue
            try:
                if req.grammar is not None:
                    req.grammar.accept(token)
                req.output_ids.append(token)
                req.first_token_time = req.first_token_time or now
                self.stats["generated_tokens"] += 1
                reason = self._check_finished(req, token)
            except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
                self.fail_request(req, e, "processing its new token", seq_lens[i])
                continue
            if id(req) not in running:  # its prefill is complete: it joins decode
                self.running.append(req)
            if reason is not None:
                self.running.remove(req)
                self.kv.release(req)
                self._finish(req, reason)
        return reqs

    def fail_request(self, req: Req, error: Exception, stage: str, kv_len: int) -> None:
        """End one request with an error (HTTP 400 when its own values caused it, else 500):
        out of the running batch, its KV (`kv_len` tokens allocated) freed."""
        status = isolation.status_for(error)
        logger.error("request %s failed while %s (HTTP %d): %s: %s", req.rid, stage, status,
                     type(error).__name__, error, exc_info=status >= 500)
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        req.kv_len = kv_len
        self.kv.release(req, cache=False)  # its KV may be half-written: never reused
        self.stats["failed_requests"] += 1
        self._finish(req, {"type": "abort", "status_code": status,
                           "message": f"the request failed while {stage}: "
                                      f"{type(error).__name__}: {error}"})

    def fail_unattributed(self, message: str, tracked: list[Req] = ()) -> list[Req]:
        """A step raised where no request could be blamed: fail every running request (the
        step may have left them half-updated) and every `tracked` request that is neither
        waiting nor finished (caught between queues); the waiting ones (and those whose
        grammar compiles) stay queued. Their KV pages, those a half-built batch allocated
        included, are freed."""
        queued = set(map(id, [*self.waiting, *self.grammar_queue.pending]))
        limbo = [r for r in tracked if id(r) not in queued and not r.finished
                 and r not in self.holders()]
        for req in self.holders() + limbo:
            self.fail_request(req, RuntimeError(message), "running a batch", req.kv_len)
        updated, self._finished = self._finished, []
        return updated

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
        if req.grammar is not None and req.grammar.terminated:  # ended with ignore_eos set
            return {"type": "stop", "matched": token}
        if len(req.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        if req.seq_len >= self.context_len:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _finish(self, req: Req, reason: dict) -> None:
        req.finished_reason = reason
        req.finished_time = time.perf_counter()
        req.decoder.flush(req.output_ids)
        if "status_code" not in reason:  # failed ones are counted as failed_requests
            key = "aborted_requests" if reason["type"] == "abort" else "finished_requests"
            self.stats[key] += 1
        self._finished.append(req)
