"""Logprobs from the scheduler's own forward passes against log_softmax of transformers'
float32 logits on the same tiny model; logit_bias under greedy.

Tolerance: 1e-4 absolute on logprobs (float32 on both sides, different kernels and reduction
orders; the tiny model's logprobs are of order -6).
"""

from __future__ import annotations

import pytest
import torch

from airserve import Engine
from airserve.srt.managers.engine_core import build_req
from airserve.srt.sampling.logprobs import LogprobParams
from airserve.srt.sampling.sampling_params import SamplingParams
from airserve_testing.tiny_models import load_hf

ATOL = 1e-4
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    # page 1: the prefix cache matches any length, so a cap inside a cached prefix shows.
    return Engine(model_path=tiny_llama_dir, max_total_tokens=2048, max_running_requests=8,
                  page_size=1)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return load_hf(tiny_llama_dir)


def reference(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is log P(. | ids[:p + 1]) from transformers in float32."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def run(engine, prompts, logprob: LogprobParams, params=GREEDY):
    reqs = [build_req(engine.tokenizer, p, SamplingParams.from_dict(params), logprob=logprob)
            for p in prompts]
    for r in reqs:
        engine.scheduler.add_request(r)
    while not all(r.finished for r in reqs):
        engine.scheduler.step()
    return reqs


def prompts(vocab, lengths, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def check_against_reference(hf, req, start: int, top: int) -> None:
    ids = req.input_ids + req.output_ids
    ref = reference(hf, ids)
    n = len(req.input_ids)
    assert len(req.input_logprobs) == n - 1 - start
    for i, t in enumerate(req.input_logprobs):
        pos = start + 1 + i  # token scored, from the logits at pos - 1
        assert t.token_id == ids[pos]
        assert abs(t.logprob - float(ref[pos - 1, ids[pos]])) < ATOL
    assert len(req.output_logprobs) == len(req.output_ids)
    for i, t in enumerate(req.output_logprobs):
        pos = n + i
        assert t.token_id == ids[pos]
        assert abs(t.logprob - float(ref[pos - 1, ids[pos]])) < ATOL
        if top:
            vals, idx = torch.topk(ref[pos - 1], top)
            assert [tok for _, tok in t.top] == idx.tolist()
            assert max(abs(a - float(b)) for (a, _), b in zip(t.top, vals)) < ATOL
            # Greedy: the chosen token is the best one.
            assert t.top[0][1] == t.token_id


@pytest.mark.parametrize("start", [0, 5])
def test_prompt_and_output_logprobs_equal_transformers(engine, hf, start):
    vocab = engine.model_runner.model_config.vocab_size
    batch = prompts(vocab, [9, 23, 14])
    reqs = run(engine, batch, LogprobParams(True, 3, start))
    for req in reqs:
        check_against_reference(hf, req, start, 3)


def test_default_start_scores_no_prompt_token(engine, hf):
    vocab = engine.model_runner.model_config.vocab_size
    (req,) = run(engine, prompts(vocab, [12], seed=8), LogprobParams(True, 0, -1))
    assert req.input_logprobs == []
    check_against_reference(hf, req, 11, 0)


def test_cached_prefix_is_recomputed_from_logprob_start(engine, hf):
    """The second request's prompt is cached whole (the first ran it): its prompt logprobs
    from position 2 must still come, from a prefill that starts there."""
    vocab = engine.model_runner.model_config.vocab_size
    (p,) = prompts(vocab, [20], seed=9)
    run(engine, [p], LogprobParams())
    (req,) = run(engine, [p], LogprobParams(True, 2, 2))
    assert req.cached_tokens == 2  # the cache supplied exactly the tokens before the start
    check_against_reference(hf, req, 2, 2)
    (plain,) = run(engine, [p], LogprobParams())
    assert plain.cached_tokens == len(p) - 1  # requests without prompt logprobs keep the hit


def test_chunked_prefill_gathers_prompt_logprobs_across_chunks(tiny_llama_dir, hf):
    engine = Engine(model_path=tiny_llama_dir, max_total_tokens=2048, max_running_requests=4,
                    chunked_prefill_size=8)
    vocab = engine.model_runner.model_config.vocab_size
    reqs = run(engine, prompts(vocab, [30, 11], seed=10), LogprobParams(True, 1, 3))
    for req in reqs:
        check_against_reference(hf, req, 3, 1)


def test_logit_bias_forces_a_token_and_logprobs_stay_raw(engine, hf):
    vocab = engine.model_runner.model_config.vocab_size
    (p,) = prompts(vocab, [10], seed=11)
    forced = 42
    params = {**GREEDY, "logit_bias": {str(forced): 100.0}}
    (req,) = run(engine, [p], LogprobParams(True, 0, -1), params)
    assert req.output_ids == [forced] * GREEDY["max_new_tokens"]
    check_against_reference(hf, req, len(p) - 1, 0)  # the raw distribution, not the biased
    (free,) = run(engine, [p], LogprobParams(), GREEDY)
    assert free.output_ids != req.output_ids
    banned = {**GREEDY, "logit_bias": {str(t): -100.0 for t in free.output_ids}}
    (req,) = run(engine, [p], LogprobParams(), banned)
    assert not set(req.output_ids) & set(free.output_ids)


def test_graph_runner_replay_gives_the_same_logprobs(tiny_llama_dir, hf):
    """Decode steps replayed by the CPU graph runner (inductor): output logprobs from the
    replay's logits, the same tolerance."""
    engine = Engine(model_path=tiny_llama_dir, max_total_tokens=1024, max_running_requests=2,
                    enable_torch_compile=True, cuda_graph_bs=(2,))  # one bucket: one compile
    vocab = engine.model_runner.model_config.vocab_size
    reqs = run(engine, prompts(vocab, [7, 13], seed=12), LogprobParams(True, 2, 0))
    runner = engine.model_runner
    assert runner.graph_replays >= GREEDY["max_new_tokens"] - 1 and not runner.fallback_counts
    for req in reqs:
        check_against_reference(hf, req, 0, 2)


def test_offline_engine_still_refuses_n(engine):
    """n > 1 is a front-door expansion (HTTP); the offline Engine refuses it by name."""
    with pytest.raises(ValueError, match="n: not supported"):
        engine.generate(input_ids=[1, 2, 3], sampling_params={"n": 2})
