"""Mixed steps (--enable-mixed-chunk) with the CPU graph runner, and the per-step spans.

A mixed step carries the running requests as one-token extends beside a prefill chunk; it runs
eager by nature and must not be counted as an eager fallback, while the steps without prefill
keep replaying the decode graphs. The spans (step_spans.py) file each step under its kind and
its number of decode rows.
"""

from __future__ import annotations

import pytest
import torch

from airserve import Engine
from airserve.srt.managers import step_spans
from airserve.srt.managers.engine_core import build_req, eos_token_ids
from airserve.srt.managers.scheduler import Scheduler, SchedulerConfig
from airserve.srt.sampling.sampling_params import SamplingParams

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def graph_engine(tiny_llama_dir):
    # One bucket of 4 (compiling is slow on 2 cores): decode batches of 1-4 replay padded.
    return Engine(model_path=tiny_llama_dir, max_total_tokens=1024, max_running_requests=4,
                  enable_torch_compile=True, cuda_graph_bs=[4])


def run(engine: Engine, **config) -> tuple[Scheduler, list[list[int]]]:
    """Three prompts, a new one arriving every other step while earlier ones decode."""
    g = torch.Generator().manual_seed(5)
    vocab = engine.model_runner.model_config.vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (30, 12, 41)]
    eos = eos_token_ids(engine.model_runner, engine.tokenizer)
    sched = Scheduler(engine.model_runner, eos, SchedulerConfig(**config))
    reqs = [build_req(engine.tokenizer, p, SamplingParams.from_dict(GREEDY)) for p in prompts]
    pending = list(reqs)
    steps = 0
    while not all(r.finished for r in reqs):
        if pending and steps % 2 == 0:
            sched.add_request(pending.pop(0))
        sched.step()
        steps += 1
    sched.flush_cache()
    return sched, [r.output_ids for r in reqs]


def test_mixed_steps_are_no_fallback_and_decode_steps_replay(graph_engine):
    runner = graph_engine.model_runner
    _, plain = run(graph_engine, chunked_prefill_size=16)
    replays, fallbacks = runner.graph_replays, dict(runner.fallback_counts)
    sched, mixed = run(graph_engine, chunked_prefill_size=16, enable_mixed_chunk=True)
    spans = sched.spans.report()
    assert sched.stats["mixed_steps"] == sum(e["steps"] for e in spans["mixed"].values()) > 0
    decode_steps = sum(e["steps"] for e in spans["decode"].values())
    # Every step without prefill replayed a graph; the mixed ones were not fallbacks.
    assert decode_steps > 0
    assert runner.graph_replays - replays == decode_steps
    assert dict(runner.fallback_counts) == fallbacks == {}
    assert mixed == plain  # greedy: a mixed step's decode rows give the decode step's tokens


def test_spans_file_steps_by_kind_and_decode_rows(tiny_llama_dir):
    engine = Engine(model_path=tiny_llama_dir, max_total_tokens=1024, max_running_requests=4)
    sched, _ = run(engine, chunked_prefill_size=16, enable_mixed_chunk=True)
    rows = step_spans.summary(sched.spans.report())
    kinds = {r["kind"] for r in rows}
    assert kinds == {"prefill", "mixed", "decode"}
    for r in rows:
        assert (r["decode_rows"] == "0") == (r["kind"] == "prefill")
        assert r["forward_ms"] > 0
        assert (r["mean_prefill_tokens"] > 0) == (r["kind"] != "decode")
    # Chunks of 16: the 41-token prompt is read in 3 steps, no step takes more.
    assert max(r["mean_prefill_tokens"] for r in rows) <= 16
    prompt_tokens = sum(e["prefill_tokens"] for b in sched.spans.report().values()
                        for e in b.values())
    assert prompt_tokens == sched.stats["prefill_tokens"] == 30 + 12 + 41


def test_span_bands_and_diff():
    assert [step_spans.band(n) for n in (0, 1, 4, 5, 16, 17, 32, 33, 200)] == [
        "0", "1-4", "1-4", "5-8", "9-16", "17-32", "17-32", "33+", "33+"]
    spans = step_spans.StepSpans()
    spans.record(3, 0, 0, 0.001, 0.010, 0.002)
    before = spans.report()
    spans.record(3, 1, 64, 0.001, 0.050, 0.002)
    spans.record(20, 0, 0, 0.001, 0.030, 0.002)
    delta = step_spans.diff(spans.report(), before)
    assert set(delta) == {"mixed", "decode"}
    assert delta["mixed"]["1-4"]["prefill_tokens"] == 64
    assert list(delta["decode"]) == ["17-32"]  # the 1-4 decode band did not move
    rows = step_spans.summary(delta)
    assert [(r["kind"], r["forward_ms"]) for r in rows] == [("decode", 30.0), ("mixed", 50.0)]
