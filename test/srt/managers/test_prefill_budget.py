"""The decode-aware prefill budget (--decode-chunked-prefill-size) on a tiny random model:
while requests decode, at least as many as prompts wait, a prefill step takes at most the
budget and never follows another prefill step; an idle server, or one with more prompts
waiting than streams running, keeps the full chunk; greedy outputs do not depend on the budget."""

from __future__ import annotations

import pytest
import torch

from airserve import Engine
from airserve.srt.forward_batch import ForwardMode
from airserve.srt.managers.engine_core import build_req, eos_token_ids
from airserve.srt.managers.scheduler import Scheduler, SchedulerConfig
from airserve.srt.sampling.sampling_params import SamplingParams
from airserve.srt.server_args import ServerArgs

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
CHUNK = 32


@pytest.fixture(scope="module", params=[1, 4], ids=["page1", "page4"])
def engine(request, tiny_llama_dir):
    return Engine(model_path=tiny_llama_dir, max_total_tokens=2048, max_running_requests=8,
                  page_size=request.param)


class TracingScheduler(Scheduler):
    """Records each step as (prefill tokens, decode rows, streams decoding when built); and in
    `limited` whether the budget held then (streams decoding, at least as many as prompts
    waiting)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trace: list[tuple[int, int, int]] = []
        self.limited: list[bool] = []

    def next_batch(self):
        decoding, waiting = len(self.running), self.num_waiting()
        batch = super().next_batch()
        if batch is not None:
            self.limited.append(0 < decoding and waiting <= decoding)
            rows = [r.extend_len for r in batch.reqs]
            if batch.fb.forward_mode == ForwardMode.DECODE:
                self.trace.append((0, len(rows), decoding))
            else:  # prefill rows come first; a mixed batch's decode rows follow
                n_prefill = len(rows) - (decoding if self.config.enable_mixed_chunk else 0)
                self.trace.append((sum(rows[:n_prefill]), len(rows) - n_prefill, decoding))
        return batch

    def limited_prefill(self) -> list[int]:
        """Prompt tokens of each prefill step built while the budget held."""
        return [t for (t, _, _), held in zip(self.trace, self.limited) if t and held]


def run_staggered(engine: Engine, prompts: list[list[int]], **config) -> TracingScheduler:
    """Two prompts arrive at once, then one more every other step while those decode; the KV
    audit runs after every step."""
    eos = eos_token_ids(engine.model_runner, engine.tokenizer)
    sched = TracingScheduler(engine.model_runner, eos, SchedulerConfig(**config))
    reqs = [build_req(engine.tokenizer, p, SamplingParams.from_dict(GREEDY)) for p in prompts]
    pending = list(reqs)
    sched.add_request(pending.pop(0))
    sched.add_request(pending.pop(0))
    steps = 0
    while not all(r.finished for r in reqs):
        if pending and steps % 2:
            sched.add_request(pending.pop(0))
        sched.step()
        sched.kv.audit(sched.holders())
        steps += 1
    sched.outputs = [r.output_ids for r in reqs]
    sched.flush_cache()
    assert engine.model_runner.allocator.available_pages() == \
        engine.model_runner.allocator.total_usable_pages
    return sched


def make_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(21)
    shared = torch.randint(1, vocab, (20,), generator=g).tolist()
    lengths = (40, 9, 70, 25, 50, 33)
    return [(shared if i % 2 else []) + torch.randint(1, vocab, (n,), generator=g).tolist()
            for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def reference(engine) -> TracingScheduler:
    """Whole prompts, no cache, no budget."""
    return run_staggered(engine, make_prompts(engine.model_runner.model_config.vocab_size),
                         radix_cache=False)


def test_budget_applies_only_while_requests_decode(engine):
    prompts = make_prompts(engine.model_runner.model_config.vocab_size)
    sched = run_staggered(engine, prompts, chunked_prefill_size=CHUNK,
                          decode_chunked_prefill_size=6)
    prefill = [(tokens, decoding) for tokens, _, decoding in sched.trace if tokens]
    assert sched.limited_prefill() and max(sched.limited_prefill()) <= 6
    # Idle, the first two prompts (40 and 29 + 20 tokens) are read a full chunk per step.
    assert prefill[0] == (CHUNK, 0)
    assert sched.stats["prefill_budget_limited_steps"] > 0
    assert sched.stats["interleaved_decode_steps"] > 0


def test_no_two_prefill_steps_in_a_row_while_streams_wait(engine):
    prompts = make_prompts(engine.model_runner.model_config.vocab_size)

    def back_to_back(sched, limited: bool = True) -> int:
        """Prefill steps built while the budget held (or while streams decoded, with `limited`
        False) that came right after a prefill step."""
        trace = sched.trace
        return sum(1 for prev, cur, held in zip(trace, trace[1:], sched.limited[1:])
                   if prev[0] and cur[0] and (held if limited else cur[2]))

    budgeted = run_staggered(engine, prompts, chunked_prefill_size=CHUNK,
                             decode_chunked_prefill_size=6)
    assert back_to_back(budgeted) == 0
    # Without the budget the same arrivals prefill back to back: the check above can fail.
    plain = run_staggered(engine, prompts, chunked_prefill_size=CHUNK)
    assert back_to_back(plain) > 0
    assert plain.stats["prefill_budget_limited_steps"] == 0
    assert plain.stats["interleaved_decode_steps"] == 0


@pytest.mark.parametrize("config", [
    dict(chunked_prefill_size=CHUNK, decode_chunked_prefill_size=5),  # mid-page for page 4
    dict(chunked_prefill_size=CHUNK, decode_chunked_prefill_size=CHUNK),
    dict(chunked_prefill_size=7, decode_chunked_prefill_size=3),
    dict(chunked_prefill_size=CHUNK, decode_chunked_prefill_size=6, enable_mixed_chunk=True),
    dict(chunked_prefill_size=CHUNK, decode_chunked_prefill_size=5, schedule_policy="lpm"),
], ids=["b5", "b_chunk", "c7_b3", "b6_mixed", "b5_lpm"])
def test_greedy_outputs_do_not_depend_on_the_budget(engine, reference, config):
    prompts = make_prompts(engine.model_runner.model_config.vocab_size)
    sched = run_staggered(engine, prompts, **config)
    assert sched.outputs == reference.outputs
    budget = config["decode_chunked_prefill_size"]
    assert max(sched.limited_prefill(), default=0) <= budget
    if config.get("enable_mixed_chunk"):
        assert sched.stats["mixed_steps"] > 0


def one_stream_then(engine: Engine, lengths: tuple[int, ...], seed: int,
                    max_new_tokens: int) -> TracingScheduler:
    """A 9-token prompt prefills and decodes, then prompts of `lengths` arrive at once; runs
    to the end with the KV audit after every step (chunk CHUNK, budget 6, no cache)."""
    vocab = engine.model_runner.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (9, *lengths)]
    eos = eos_token_ids(engine.model_runner, engine.tokenizer)
    sched = TracingScheduler(engine.model_runner, eos, SchedulerConfig(
        chunked_prefill_size=CHUNK, decode_chunked_prefill_size=6, radix_cache=False))
    params = SamplingParams.from_dict({**GREEDY, "max_new_tokens": max_new_tokens})
    reqs = [build_req(engine.tokenizer, p, params) for p in prompts]
    sched.add_request(reqs[0])
    sched.step()  # its prefill; it decodes from now on
    for req in reqs[1:]:
        sched.add_request(req)
    while not all(r.finished for r in reqs):
        sched.step()
        sched.kv.audit(sched.holders())
    sched.flush_cache()
    return sched


def test_a_wave_of_prompts_takes_the_full_chunk_while_one_stream_decodes(engine):
    """One stream decodes, then four prompts arrive at once: they outnumber it, so prefill runs
    full chunks back to back until no more wait than decode; then the budget holds again."""
    sched = one_stream_then(engine, (40, 40, 40, 40), seed=5, max_new_tokens=40)
    wave = [(t, d) for t, _, d in sched.trace[1:] if t]
    assert wave[0] == (CHUNK, 1) and wave[1][0] == CHUNK  # full chunks, back to back
    assert sched.limited_prefill() and max(sched.limited_prefill()) <= 6  # then the budget


def test_one_long_prompt_beside_one_stream_is_read_within_the_budget(engine):
    """One stream decodes and one long prompt arrives: as many streams as prompts waiting, so
    every chunk of the prompt is at most the budget and a decode step follows each."""
    sched = one_stream_then(engine, (40,), seed=6, max_new_tokens=30)
    steps = sched.trace[1:]
    chunks = [t for t, _, _ in steps if t]
    assert sum(chunks) == 40 and max(chunks) <= 6
    assert all(nxt[0] == 0 for cur, nxt in zip(steps, steps[1:]) if cur[0])


def test_retraction_and_aborts_keep_pages_and_outputs(tiny_llama_dir):
    """A pool too small for every stream: retraction happens under the budget, an aborted
    half-read prompt frees its pages, the others keep their solo outputs."""
    eng = Engine(model_path=tiny_llama_dir, max_total_tokens=160, page_size=4,
                 max_running_requests=6)
    prompts = make_prompts(eng.model_runner.model_config.vocab_size)[:4]
    params = {**GREEDY, "max_new_tokens": 60}  # two streams outgrow the pool: retraction
    eos = eos_token_ids(eng.model_runner, eng.tokenizer)
    expected = []
    for p in prompts:
        ref = Scheduler(eng.model_runner, eos, SchedulerConfig(radix_cache=False))
        req = build_req(eng.tokenizer, p, SamplingParams.from_dict(params))
        ref.add_request(req)
        while not req.finished:
            ref.step()
        expected.append(req.output_ids)
    sched = Scheduler(eng.model_runner, eos, SchedulerConfig(chunked_prefill_size=16,
                                                             decode_chunked_prefill_size=5))
    reqs = [build_req(eng.tokenizer, p, SamplingParams.from_dict(params)) for p in prompts]
    for req in reqs:
        sched.add_request(req)
    aborted = None
    while sched.has_work():
        sched.step()
        sched.kv.audit(sched.holders())
        if aborted is None and sched.chunked_req is not None and sched.running:
            aborted = sched.chunked_req
            assert sched.abort(aborted.rid)
    assert aborted is not None and sched.stats["retractions"] > 0
    for req, want in zip(reqs, expected):
        assert req.finished
        if req is not aborted:
            assert req.output_ids == want
    assert sched.kv.audit([])["owned"] == 0
    sched.flush_cache()
    assert eng.model_runner.allocator.available_pages() == \
        eng.model_runner.allocator.total_usable_pages


@pytest.mark.parametrize("config,message", [
    (dict(decode_chunked_prefill_size=8), "needs chunked prefill"),
    (dict(chunked_prefill_size=16, decode_chunked_prefill_size=17), "1..chunked_prefill_size"),
    (dict(chunked_prefill_size=16, decode_chunked_prefill_size=0), "1..chunked_prefill_size"),
])
def test_scheduler_config_refuses_bad_budgets(config, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**config)


@pytest.mark.parametrize("kwargs,message", [
    (dict(decode_chunked_prefill_size=0), "decode_chunked_prefill_size=0: a positive"),
    (dict(decode_chunked_prefill_size=-5), "decode_chunked_prefill_size=-5: a positive"),
    (dict(chunked_prefill_size=-1, decode_chunked_prefill_size=64), "needs chunked prefill"),
    (dict(chunked_prefill_size=64, decode_chunked_prefill_size=65), "exceeds chunked_prefill"),
])
def test_server_args_refuse_bad_budgets(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_server_args_resolve_the_budget():
    assert ServerArgs().resolved_decode_chunked_prefill_size is None  # off by default
    assert ServerArgs(decode_chunked_prefill_size=-1).resolved_decode_chunked_prefill_size is None
    assert ServerArgs(chunked_prefill_size=-1).resolved_decode_chunked_prefill_size is None
    assert ServerArgs(chunked_prefill_size=64).resolved_decode_chunked_prefill_size is None
    assert ServerArgs(decode_chunked_prefill_size=32).resolved_decode_chunked_prefill_size == 32
