"""Logprobs, n > 1 and logit_bias through the real server, on every route (and the offline
Engine's against /generate's); every field that would change the output and is not implemented
is a 400 naming it.

Logprob values are checked against log_softmax of transformers' float32 logits on the same
tiny model, within 1e-4 (absolute).
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from airserve_testing.server_utils import ServerProcess
from airserve_testing.tiny_models import load_hf

ATOL = 1e-4
PROMPT = "The quick brown fox jumps"


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return load_hf(tiny_llama_dir)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)


# The tests that compare values with transformers' float32 log_softmax ask a float32 server:
# `auto` (the directory's shared server) takes bfloat16 above the packed limit on CPUs with
# avx512_bf16 or AMX, and its logprobs part from float32's by far more than ATOL. The layout
# tests stay on the shared server, on `auto`.
@pytest.fixture(scope="module")
def f32_server(tiny_llama_dir):
    srv = ServerProcess(tiny_llama_dir, "--max-total-tokens", "4096",
                        "--dtype", "float32").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def f32_http(f32_server):
    with f32_server.client() as http:
        yield http


@pytest.fixture(scope="module")
def f32_client(f32_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f32_server.url + "/v1", api_key=f32_server.api_key,
                         max_retries=0)


def ref_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def post(http, path: str, body: dict, status: int = 200):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def events(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def prompt_ids(http) -> list[int]:
    """PROMPT's token ids, as the server tokenizes it (input_token_logprobs from 0)."""
    meta = post(http, "/generate", {"text": PROMPT, "return_logprob": True,
                                    "logprob_start_len": 0,
                                    "sampling_params": {"max_new_tokens": 1}})["meta_info"]
    return [t for _, t, _ in meta["input_token_logprobs"]]


# Native /generate.
def test_generate_logprobs_layout_and_values(f32_http, hf):
    body = {"text": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 1, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    out = post(f32_http, "/generate", body)
    meta = out["meta_info"]
    prompt_len = meta["prompt_tokens"]
    inputs, outputs = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert len(inputs) == prompt_len - 1 and inputs[0][0] is None
    assert [t for _, t, _ in outputs] == out["output_ids"]
    ids = [t for _, t, _ in inputs]  # the prompt from position 1
    first = prompt_ids(f32_http)[0]
    full = [first] + ids + out["output_ids"]
    ref = ref_logprobs(hf, full)
    for pos, (lp, tok, text) in enumerate(inputs[1:] + outputs, start=2):
        assert tok == full[pos] and isinstance(text, str)
        assert abs(lp - float(ref[pos - 1, tok])) < ATOL
    assert meta["input_top_logprobs"][0] is None
    assert len(meta["output_top_logprobs"]) == 5
    for top, (_, tok, _) in zip(meta["output_top_logprobs"], outputs):
        assert len(top) == 2 and top[0][1] == tok  # greedy: the chosen token leads


def test_generate_streamed_logprobs_end_equal_the_plain_answer(http):
    body = {"text": PROMPT, "return_logprob": True, "top_logprobs_num": 1,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    plain = post(http, "/generate", body)["meta_info"]
    streamed = events(http, "/generate", {**body, "stream": True})
    last = streamed[-1]["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs"):
        assert _close(last[key], plain[key]), key
    assert plain["input_token_logprobs"] == [[None, plain["input_token_logprobs"][0][1], None]]
    # Cumulative: each event's list is as long as its output.
    assert [len(e["meta_info"]["output_token_logprobs"]) for e in streamed] == \
        [e["meta_info"]["completion_tokens"] for e in streamed]


def _close(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return abs(a - b) < ATOL
    return a == b


def test_generate_n_samples_share_the_prompt(http):
    text = PROMPT * 8  # several pages of prompt
    sampled = post(http, "/generate", {"text": text, "sampling_params": {
        "n": 3, "max_new_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": True}})
    assert isinstance(sampled, list) and len(sampled) == 3
    assert [o["index"] for o in sampled] == [0, 1, 2]
    assert len({tuple(o["output_ids"]) for o in sampled}) > 1  # seeds offset per sample
    prompt = sampled[0]["meta_info"]["prompt_tokens"]
    # The copies started after the first one's prefill: they reuse its prompt (whole pages of
    # it, up to the last token).
    page = http.get("/get_server_info").json()["kv_pool"]["page_size"]
    reused = (prompt - 1) // page * page
    assert reused > 0
    assert all(o["meta_info"]["cached_tokens"] >= reused for o in sampled[1:])
    greedy = post(http, "/generate", {"text": [text, "Hello"], "sampling_params": {
        "n": 2, "max_new_tokens": 6, "temperature": 0}})
    assert len(greedy) == 4 and [o["index"] for o in greedy] == [0, 1, 2, 3]
    assert greedy[0]["output_ids"] == greedy[1]["output_ids"]
    assert greedy[2]["output_ids"] == greedy[3]["output_ids"]
    streamed = events(http, "/generate", {"text": "Hello", "stream": True, "sampling_params": {
        "n": 2, "max_new_tokens": 4, "temperature": 0}})
    assert {e["index"] for e in streamed} == {0, 1}


def test_offline_engine_logprobs_and_n_equal_generate(f32_http, hf, tiny_llama_dir):
    """Engine.generate's logprob arguments and n answer what /generate answers for the same
    model and prompt: the same meta_info lists (ids exact, values within ATOL), the same
    seeded samples; and the values are transformers' float32 log_softmax."""
    from airserve import Engine

    engine = Engine(model_path=tiny_llama_dir, max_total_tokens=4096, num_threads=1,
                    dtype="float32")  # as f32_server
    try:
        greedy = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
        args = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}
        served = post(f32_http, "/generate", {"text": PROMPT, **args, "sampling_params": greedy})
        offline = engine.generate(PROMPT, dict(greedy), **args)
        keys = [k for k in served["meta_info"] if k.endswith("logprobs")]
        assert sorted(keys) == sorted(k for k in offline["meta_info"] if k.endswith("logprobs"))
        assert len(keys) == 4
        as_json = json.loads(json.dumps(offline["meta_info"]))  # entries: tuples -> lists
        for key in keys:
            assert _close(as_json[key], served["meta_info"][key]), key
        assert offline["output_ids"] == served["output_ids"]
        inputs = offline["meta_info"]["input_token_logprobs"]
        full = [t for _, t, _ in inputs] + offline["output_ids"]
        ref = ref_logprobs(hf, full)
        scored = inputs[1:] + offline["meta_info"]["output_token_logprobs"]
        for pos, (lp, tok, _) in enumerate(scored, start=1):
            assert abs(lp - float(ref[pos - 1, tok])) < ATOL
        sampled = {"n": 2, "max_new_tokens": 6, "temperature": 1.0, "seed": 11,
                   "ignore_eos": True}
        served = post(f32_http, "/generate", {"text": [PROMPT, "Hello"], "return_logprob": True,
                                          "sampling_params": sampled})
        offline = engine.generate([PROMPT, "Hello"], dict(sampled), return_logprob=True)
        assert [o["output_ids"] for o in offline] == [o["output_ids"] for o in served]
        for a, b in zip(offline, served):
            lists = json.loads(json.dumps(a["meta_info"]["output_token_logprobs"]))
            assert _close(lists, b["meta_info"]["output_token_logprobs"])
    finally:
        engine.shutdown()


def test_generate_logit_bias_forces_and_bans(http):
    base = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                 "ignore_eos": True}}
    free = post(http, "/generate", base)["output_ids"]
    forced = post(http, "/generate", {**base, "sampling_params": {
        **base["sampling_params"], "logit_bias": {"7": 100}}})["output_ids"]
    assert forced == [7] * 4 != free
    banned = post(http, "/generate", {**base, "sampling_params": {
        **base["sampling_params"], "logit_bias": {str(free[0]): -100}}})["output_ids"]
    assert banned[0] != free[0]


# OpenAI routes.
def test_completions_echo_logprobs_as_lm_eval_asks(f32_http, hf, f32_client):
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1."""
    ids = prompt_ids(f32_http)[:5]
    r = f32_client.completions.create(model="default", prompt=[ids, ids[:3]], max_tokens=1,
                                  temperature=0, logprobs=1, echo=True)
    for choice, prompt in zip(r.choices, [ids, ids[:3]]):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(prompt) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = ref_logprobs(hf, prompt)
        for pos in range(1, len(prompt)):
            assert abs(lp.token_logprobs[pos] - float(ref[pos - 1, prompt[pos]])) < ATOL
            assert abs(max(lp.top_logprobs[pos].values()) - float(ref[pos - 1].max())) < ATOL
        assert abs(lp.token_logprobs[-1] - float(ref[-1].max())) < ATOL  # greedy token
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    plain = f32_client.completions.create(model="default", prompt=PROMPT, max_tokens=3,
                                      temperature=0, echo=True)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None


def test_completions_streamed_logprobs(client):
    kwargs = dict(model="default", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].logprobs
    parts = [c.choices[0].logprobs for c in client.completions.create(**kwargs, stream=True)
             if c.choices[0].logprobs is not None]
    got = [v for p in parts for v in p.token_logprobs]
    assert len(got) == 5 and _close(got, full.token_logprobs)
    assert [t for p in parts for t in p.tokens] == full.tokens


def test_chat_logprobs_and_n(client):
    messages = [{"role": "user", "content": "Say something"}]
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3, n=2,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    a, b = (c.logprobs.content for c in r.choices)
    assert len(a) == 5 and [t.token for t in a] == [t.token for t in b]
    for t in a:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < ATOL and t.logprob <= 0
    chunks = list(client.chat.completions.create(
        model="default", messages=messages, max_tokens=5, temperature=0, logprobs=True,
        stream=True, n=2, extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices[0].index == 1 and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert _close([t.logprob for t in streamed], [t.logprob for t in b])


def test_openai_logit_bias(client):
    for create in (lambda **k: client.completions.create(prompt=PROMPT, **k).choices[0].text,
                   lambda **k: client.chat.completions.create(
                       messages=[{"role": "user", "content": "hi"}],
                       **k).choices[0].message.content):
        free = create(model="default", max_tokens=3, temperature=0)
        forced = create(model="default", max_tokens=3, temperature=0, logit_bias={"65": 100})
        assert forced != free and len(set(forced)) == 1


# Refusals: each case names its field, on its route.
BAD_VALUES = [
    ("/generate", {"sampling_params": {"logit_bias": {"999999": 1}}}, "logit_bias"),
    ("/generate", {"sampling_params": {"logit_bias": {"5": 101}}}, "logit_bias"),
    ("/generate", {"sampling_params": {"logit_bias": {"x": 1}}}, "logit_bias"),
    ("/generate", {"sampling_params": {"n": 0}}, "sampling_params.n"),
    ("/generate", {"return_logprob": True, "logprob_start_len": 999}, "logprob_start_len"),
    ("/generate", {"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ("/generate", {"return_logprob": True, "logprob_start_len": 0,
                   "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ("/v1/completions", {"logprobs": 101}, "logprobs"),
    ("/v1/completions", {"logprobs": 1, "echo": True, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"echo": True, "stream": True}, "echo"),
    ("/v1/completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logit_bias": {"1": -200}}, "logit_bias"),
]
NOT_IMPLEMENTED = {
    "/generate": {"return_hidden_states": True, "return_entropy": True, "input_embeds": [[0.1]],
                  "image_data": "x.png", "lora_path": "a", "session_params": {"id": "s"},
                  "custom_logit_processor": "f", "token_ids_logprob": [1],
                  "return_bytes": True, "lora_id": "a", "return_routed_experts": True,
                  "require_reasoning": True, "video_data": "v", "audio_data": "a"},
    "/generate.sampling_params": {"stop_regex": "a", "structural_tag": "{}", "no_stop_trim": True,
                                  "custom_params": {"a": 1}, "sampling_seed_offset": 1,
                                  "spaces_between_special_tokens": False},
    "/v1/completions": {"suffix": "x", "best_of": 2, "json_schema": "{}",
                        "no_stop_trim": True, "lora_path": "a", "return_hidden_states": True,
                        "prompt_logprobs": 1, "sampling_seed": 1, "token_ids_logprob": [1]},
    "/v1/chat/completions": {"continue_final_message": True, "chat_template_kwargs": {"a": 1},
                             "reasoning_effort": "low", "verbosity": "low",
                             "web_search_options": {}, "audio": {"voice": "x"},
                             "modalities": ["audio"], "functions": [{"name": "f"}],
                             "stop_regex": "a", "session_params": {"id": "s"}},
}


def base_body(path: str) -> dict:
    if path == "/generate":
        return {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    if path == "/v1/completions":
        return {"model": "default", "prompt": "Hi", "max_tokens": 2}
    return {"model": "default", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2}


def merged(path: str, extra: dict) -> dict:
    body = base_body(path)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return body


@pytest.mark.parametrize("path,extra,field", BAD_VALUES,
                         ids=[f"{p}:{f}" for p, _, f in BAD_VALUES])
def test_bad_values_are_400_naming_the_field(http, path, extra, field):
    r = http.post(path, json=merged(path, extra))
    assert r.status_code == 400, r.text
    assert field in r.text


@pytest.mark.parametrize("route,field", [(r, f) for r, fields in NOT_IMPLEMENTED.items()
                                         for f in fields])
def test_not_implemented_fields_are_400_naming_them(http, route, field):
    value = NOT_IMPLEMENTED[route][field]
    if route == "/generate.sampling_params":
        path, extra = "/generate", {"sampling_params": {field: value}}
    else:
        path, extra = route, {field: value}
    r = http.post(path, json=merged(path, extra))
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
