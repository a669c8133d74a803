"""Logprobs from the scheduler's own forward passes (also through Engine.generate's logprob
arguments) against log_softmax of transformers' float32 logits on the same tiny model;
logit_bias under greedy; Engine.generate's n.

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
# Every engine here multiplies in float32, whatever the CPU: the references are transformers'
# float32 logits. `auto` takes bfloat16 for batches above the packed limit on CPUs with
# avx512_bf16 or AMX, and its logprobs part from float32's by far more than ATOL.
F32 = {"dtype": "float32"}
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    # page 1: the prefix cache matches any length, so a cap inside a cached prefix shows.
    return Engine(model_path=tiny_llama_dir, max_total_tokens=2048, max_running_requests=8,
                  page_size=1, **F32)


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
                    chunked_prefill_size=8, **F32)
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
                    enable_torch_compile=True, cuda_graph_bs=(2,),  # one bucket: one compile
                    **F32)
    vocab = engine.model_runner.model_config.vocab_size
    reqs = run(engine, prompts(vocab, [7, 13], seed=12), LogprobParams(True, 2, 0))
    runner = engine.model_runner
    assert runner.graph_replays >= GREEDY["max_new_tokens"] - 1 and not runner.fallback_counts
    for req in reqs:
        check_against_reference(hf, req, 0, 2)


# Engine.generate's logprob arguments: /generate's meta_info layout, the same values.
def test_engine_generate_logprobs_equal_transformers(engine, hf):
    vocab = engine.model_runner.model_config.vocab_size
    batch = prompts(vocab, [9, 15], seed=13)
    outs = engine.generate(input_ids=batch, sampling_params=GREEDY, return_logprob=True,
                           logprob_start_len=[0, 4], top_logprobs_num=2)
    for ids, start, out in zip(batch, [0, 4], outs):
        meta = out["meta_info"]
        inputs, outputs = meta["input_token_logprobs"], meta["output_token_logprobs"]
        assert [t for _, t, _ in inputs] == ids[start:]  # one per prompt token from start
        assert inputs[0][0] is None and meta["input_top_logprobs"][0] is None
        assert [t for _, t, _ in outputs] == out["output_ids"]
        assert len(out["output_ids"]) == GREEDY["max_new_tokens"]
        full = ids + out["output_ids"]
        ref = reference(hf, full)
        scored = inputs[1:] + outputs
        tops = meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]
        for pos, ((lp, tok, text), top) in enumerate(zip(scored, tops), start=start + 1):
            assert tok == full[pos] and text is None
            assert abs(lp - float(ref[pos - 1, tok])) < ATOL
            vals, idx = torch.topk(ref[pos - 1], 2)
            assert [t for _, t, _ in top] == idx.tolist()
            assert max(abs(a - float(b)) for (a, _, _), b in zip(top, vals)) < ATOL


def test_engine_generate_without_return_logprob_has_no_logprob_fields(engine):
    out = engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, top_logprobs_num=2)
    assert not [k for k in out["meta_info"] if "logprobs" in k]


def test_engine_streaming_logprobs_grow_with_the_output(engine, hf):
    vocab = engine.model_runner.model_config.vocab_size
    (ids,) = prompts(vocab, [11], seed=14)
    chunks = list(engine.generate(input_ids=ids, sampling_params=GREEDY, stream=True,
                                  return_logprob=True))
    final = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
    for c in chunks:
        outputs = c["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in outputs] == c["output_ids"]
    last = chunks[-1]["meta_info"]
    want = final["meta_info"]["output_token_logprobs"]  # its prompt came from the cache
    assert [t for _, t, _ in last["output_token_logprobs"]] == [t for _, t, _ in want]
    assert max(abs(a - b) for (a, _, _), (b, _, _) in zip(last["output_token_logprobs"],
                                                          want)) < ATOL
    assert [t for _, t, _ in last["input_token_logprobs"]] == ids[-1:]


def test_engine_n_samples_per_prompt(engine):
    """n > 1: n samples per prompt, prompt by prompt, seeds offset per sample (seed, seed+1)
    as /generate does; a single prompt then answers a list."""
    params = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "seed": 5}
    batch = [[3, 4, 5, 6], [7, 8, 9]]
    outs = engine.generate(input_ids=batch, sampling_params={**params, "n": 2},
                           return_logprob=True)
    assert len(outs) == 4
    for k, out in enumerate(outs):
        ids, j = batch[k // 2], k % 2
        alone = engine.generate(input_ids=ids, sampling_params={**params, "seed": 5 + j},
                                return_logprob=True)
        assert out["output_ids"] == alone["output_ids"]
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    assert outs[0]["output_ids"] != outs[1]["output_ids"]  # different seeds, different samples
    single = engine.generate(input_ids=batch[0], sampling_params={**params, "n": 2})
    assert [o["output_ids"] for o in single] == [o["output_ids"] for o in outs[:2]]
    streamed = list(engine.generate(input_ids=batch[0], sampling_params={**params, "n": 2},
                                    stream=True))
    assert {c["index"] for c in streamed} == {0, 1}


@pytest.mark.parametrize("kwargs,message", [
    ({"return_logprob": "yes"}, "return_logprob: must be"),
    ({"return_logprob": True, "logprob_start_len": 3}, r"logprob_start_len: must be < the "
                                                        r"prompt length \(3 tokens\)"),
    ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len: must be"),
    ({"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num: must be"),
    ({"return_logprob": True, "top_logprobs_num": [1, 2]},
     "top_logprobs_num: has 2 entries for 1 prompts"),
    ({"return_logprob": True, "logprob_start_len": 0,
      "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens: must be >= 1"),
    ({"sampling_params": {"n": 0}}, r"sampling_params.n: must be an integer in \[1, 64\]"),
    ({"sampling_params": {"n": 65}}, "sampling_params.n: must be"),
    ({"sampling_params": {"n": True}}, "sampling_params.n: must be"),
])
def test_engine_bad_logprob_and_n_arguments_are_named(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(input_ids=kwargs.pop("input_ids", [1, 2, 3]), **kwargs)


def test_engine_n_must_agree_across_prompts(engine):
    with pytest.raises(ValueError, match="sampling_params.n: must be the same"):
        engine.generate(input_ids=[[1, 2], [3, 4]], sampling_params=[{"n": 2}, {"n": 3}])
