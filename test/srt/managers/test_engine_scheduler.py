"""Continuous batching, retraction, stopping and the offline Engine on a tiny random model."""

from __future__ import annotations

import pytest
import torch

from airserve import Engine
from airserve.srt.tokenizer import IncrementalDecoder, load_hf_tokenizer
from airserve_testing.tiny_models import load_hf

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return Engine(model_path=tiny_llama_dir, max_total_tokens=4096, max_running_requests=8)


def hf_greedy(path, prompt_ids, n):
    hf = load_hf(path)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def prompts(vocab, lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def test_batched_greedy_equals_transformers(tiny_llama_dir):
    # float32 whatever the CPU, as transformers' reference: `auto` takes bfloat16 above the
    # packed limit on CPUs with avx512_bf16 or AMX, and the tiny random model's greedy ids then
    # part from float32's. The other tests here compare the engine with itself, on `auto`.
    with Engine(model_path=tiny_llama_dir, max_total_tokens=4096, max_running_requests=8,
                dtype="float32") as engine:
        ids = prompts(engine.model_runner.model_config.vocab_size, [3, 17, 40, 9])
        outs = engine.generate(input_ids=ids, sampling_params=GREEDY)
    for p, out in zip(ids, outs):
        assert out["output_ids"] == hf_greedy(tiny_llama_dir, p, 24)
        assert out["meta_info"]["completion_tokens"] == 24
        assert out["meta_info"]["prompt_tokens"] == len(p)
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 24}


def test_requests_joining_a_running_batch_get_their_solo_outputs(engine):
    ids = prompts(engine.model_runner.model_config.vocab_size, [5, 30, 12, 7, 22, 16], seed=5)
    solo = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in ids]
    sched = engine.scheduler
    from airserve.srt.managers.engine_core import build_req
    from airserve.srt.sampling.sampling_params import SamplingParams

    reqs = [build_req(engine.tokenizer, p, SamplingParams.from_dict(GREEDY)) for p in ids]
    # Two arrive now, the rest one per step while the first ones decode.
    pending = list(reqs)
    sched.add_request(pending.pop(0))
    sched.add_request(pending.pop(0))
    batch_sizes = []
    while not all(r.finished for r in reqs):
        if pending:
            sched.add_request(pending.pop(0))
        sched.step()
        batch_sizes.append(len(sched.running))
    assert max(batch_sizes) >= 4  # they really ran together
    assert [r.output_ids for r in reqs] == solo


def test_pool_too_small_for_all_requests_retracts_and_still_completes(tiny_llama_dir, engine):
    ids = prompts(engine.model_runner.model_config.vocab_size, [20, 25, 30, 18, 22, 27], seed=9)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    solo = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in ids]
    small = Engine(model_path=tiny_llama_dir, max_total_tokens=128, page_size=4,
                   max_running_requests=6)
    outs = small.generate(input_ids=ids, sampling_params=params)
    assert small.scheduler.stats["retractions"] > 0
    assert [o["output_ids"] for o in outs] == solo
    assert all(o["meta_info"]["completion_tokens"] == 40 for o in outs)
    # Every page came back: free, or held by the prefix cache until it is flushed.
    cache = small.scheduler.cache_report()
    assert small.model_runner.allocator.available_tokens() + cache["cached_tokens"] == 128
    small.scheduler.flush_cache()
    assert small.model_runner.allocator.available_tokens() == 128


def test_stop_strings_are_trimmed_and_stop_token_ids_stop(engine):
    full = engine.generate("The quick brown", GREEDY)
    text, ids = full["text"], full["output_ids"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("random model produced whitespace at the cut point")
    out = engine.generate("The quick brown", {**GREEDY, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]
    out = engine.generate("The quick brown", {**GREEDY, "stop_token_ids": [ids[5]]})
    assert out["output_ids"] == ids[: ids.index(ids[5]) + 1]
    assert out["meta_info"]["finish_reason"]["matched"] == ids[5]


def test_eos_stops_unless_ignored_and_min_new_tokens(engine):
    eos = engine.tokenizer.eos_token_ids[0]
    # Force the model to emit EOS by banning nothing but raising EOS's logit via a stop id
    # is not possible; instead check that min_new_tokens delays a stop_token finish.
    full = engine.generate("Hello", GREEDY)["output_ids"]
    out = engine.generate("Hello", {**GREEDY, "stop_token_ids": [full[0]], "min_new_tokens": 0})
    assert len(out["output_ids"]) == 1
    assert eos in engine.scheduler.eos_token_ids


def test_max_new_tokens_zero_returns_empty(engine):
    out = engine.generate("Hello", {"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"


def test_seeded_sampling_is_reproducible(engine):
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 16, "seed": 42,
              "ignore_eos": True}
    a = engine.generate(["Hello", "fox"], params)
    b = engine.generate(["Hello", "fox"], params)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    c = engine.generate(["Hello", "fox"], {**params, "seed": 43})
    assert [o["output_ids"] for o in a] != [o["output_ids"] for o in c]


def test_streaming_yields_cumulative_text_ending_in_the_full_output(engine):
    full = engine.generate("Héllo wörld", GREEDY)
    chunks = list(engine.generate("Héllo wörld", GREEDY, stream=True))
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == full["text"] and chunks[-1]["meta_info"]["finish_reason"] is not None


@pytest.mark.parametrize("kwargs,message", [
    ({}, "exactly one of prompt or input_ids"),
    ({"prompt": "a", "input_ids": [1]}, "exactly one"),
    ({"prompt": 5}, "prompt: must be a string"),
    ({"input_ids": [1, -2]}, "input_ids: must be a list of integers"),
    ({"prompt": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"prompt": "a", "sampling_params": {"max_tokens": 3}}, "max_tokens"),
    ({"prompt": ["a", "b"], "sampling_params": [{}]}, "1 entries for 2 prompts"),
    ({"input_ids": list(range(1, 200)) * 3}, "context length of 512"),
    # The same rules as the HTTP front doors (managers/validation.py).
    ({"prompt": "a", "sampling_params": {"seed": 2**64}}, r"seed: .*9223372036854775807\]"),
    ({"prompt": "a", "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
    ({"prompt": "a", "sampling_params": {"structural_tag": "{}"}},
     "structural_tag: not supported"),
    ({"prompt": "a", "sampling_params": {"json_schema": "{"}}, "json_schema: cannot be compiled"),
    ({"prompt": "a", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}},
     "ebnf: only one constraint"),
    ({"prompt": "a\ud800"}, "prompt: holds a lone UTF-16 surrogate"),
])
def test_bad_arguments_raise_value_error_naming_the_field(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)


def test_unknown_server_argument_is_named():
    with pytest.raises(ValueError, match="no_such_flag"):
        Engine(no_such_flag=1)


def test_incremental_decoder_never_splits_multibyte_characters(tiny_llama_dir):
    tok = load_hf_tokenizer(tiny_llama_dir)
    text = "Héllo 你好 世界 🙂 ünïcode"
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    pieces = [dec.step(ids[: i + 1]) for i in range(len(ids))]
    pieces.append(dec.flush(ids))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == tok.decode(ids)


def test_chat_template_renders(tiny_llama_dir):
    tok = load_hf_tokenizer(tiny_llama_dir)
    s = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert s == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode("<|im_start|>")[0] == tok.tokenizer.token_to_id("<|im_start|>")
