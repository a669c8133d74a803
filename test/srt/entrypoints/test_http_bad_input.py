"""Bad requests get a 4xx with an OpenAI-style error body naming the problem; the server
keeps serving after each of them."""

from __future__ import annotations

import pytest

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 80  # far beyond 512 tokens
C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
MSG = [{"role": "user", "content": "hi"}]

# (name, path, body (dict, or str sent raw), headers override, status, message substring)
CASES = [
    ("malformed json", C, '{"prompt": "x",', None, 400, "not valid JSON"),
    ("empty body", C, "", None, 400, "empty"),
    ("json array body", GEN, "[1, 2]", None, 400, "JSON object"),
    ("missing prompt", C, {"max_tokens": 2}, None, 400, "prompt: Field required"),
    ("missing messages", CHAT, {"max_tokens": 2}, None, 400, "messages: Field required"),
    ("empty messages", CHAT, {"messages": []}, None, 400, "messages"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, None, 400,
     "messages.0.role"),
    ("image content", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, None, 400, "image_url"),
    ("prompt wrong type", C, {"prompt": 5}, None, 400, "prompt: must be"),
    ("max_tokens wrong type", C, {"prompt": "x", "max_tokens": "ten"}, None, 400,
     "max_tokens"),
    ("max_tokens negative", C, {"prompt": "x", "max_tokens": -1}, None, 400, "max_tokens"),
    ("max_tokens absurd", C, {"prompt": "x", "max_tokens": 10**12}, None, 400,
     "context length"),
    ("temperature negative", C, {"prompt": "x", "temperature": -0.5}, None, 400,
     "temperature"),
    ("top_p above one", CHAT, {"messages": MSG, "top_p": 2}, None, 400, "top_p"),
    ("n zero", C, {"prompt": "x", "n": 0}, None, 400, "n:"),
    ("n absurd", C, {"prompt": "x", "n": 100000}, None, 400, "n:"),
    ("stop wrong type", C, {"prompt": "x", "stop": 5}, None, 400, "stop: must be"),
    ("seed wrong type", C, {"prompt": "x", "seed": "s"}, None, 400, "seed"),
    ("stream wrong type", C, {"prompt": "x", "stream": "yes"}, None, 400, "stream"),
    ("logprobs out of range", C, {"prompt": "x", "logprobs": 1000}, None, 400, "logprobs"),
    ("token id out of vocab", C, {"prompt": [1, 10**9]}, None, 400,
     "prompt: must be a list of integers in [0, "),
    ("prompt longer than context", C, {"prompt": LONG_PROMPT, "max_tokens": 1}, None, 400,
     "context length"),
    ("chat prompt longer than context", CHAT,
     {"messages": [{"role": "user", "content": LONG_PROMPT}]}, None, 400, "context length"),
    ("unknown model", C, {"model": "gpt-17", "prompt": "x"}, None, 404, "gpt-17"),
    ("wrong api key", C, {"prompt": "x"}, {"Authorization": "Bearer nope"}, 401, "API key"),
    ("missing api key", GEN, {"text": "x"}, {"Authorization": ""}, 401, "API key"),
    ("generate without prompt", GEN, {"sampling_params": {}}, None, 400,
     "text or input_ids"),
    ("generate with both", GEN, {"text": "x", "input_ids": [1]}, None, 400,
     "text or input_ids"),
    ("generate empty text", GEN, {"text": ""}, None, 400, "empty"),
    ("generate text wrong type", GEN, {"text": 3}, None, 400, "text:"),
    ("generate bad input_ids", GEN, {"input_ids": ["a"]}, None, 400, "input_ids"),
    ("generate id out of vocab", GEN, {"input_ids": [10**9]}, None, 400, "input_ids"),
    ("generate unknown sampling field", GEN, {"text": "x", "sampling_params": {"tempo": 1}},
     None, 400, "tempo"),
    ("generate negative max_new_tokens", GEN,
     {"text": "x", "sampling_params": {"max_new_tokens": -1}}, None, 400, "max_new_tokens"),
    ("generate sampling_params wrong type", GEN, {"text": "x", "sampling_params": "hot"},
     None, 400, "sampling_params"),
    ("generate stream wrong type", GEN, {"text": "x", "stream": 1}, None, 400, "stream"),
    ("generate return_logprob", GEN, {"text": "x", "return_logprob": "yes"}, None, 400,
     "return_logprob"),
    ("generate too long", GEN, {"text": LONG_PROMPT}, None, 400, "context length"),
    ("unknown route", "/v2/whatever", {}, None, 404, "Not Found"),
]


@pytest.mark.parametrize("name,path,body,headers,status,message", CASES,
                         ids=[c[0] for c in CASES])
def test_bad_input(http, name, path, body, headers, status, message):
    if isinstance(body, str):
        headers = {"Content-Type": "application/json", **(headers or {})}
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    r = http.post(path, headers=headers, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"], error
    assert error["code"] == status and isinstance(error["type"], str)


def test_wrong_method(http):
    r = http.get("/generate")
    assert r.status_code == 405 and "error" in r.json()


def test_still_serving_after_bad_input(http):
    for _ in range(3):
        http.post(C, content="{oops", headers={"Content-Type": "application/json"})
    r = http.post(GEN, json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200
    assert http.get("/health").status_code == 200
    info = http.get("/get_server_info").json()
    assert info["stats"]["num_running_reqs"] == 0
    cache = info["stats"]["prefix_cache"]  # every page is free or cached, none locked
    # Available KV counts the pages the cache could evict, as in SGLang.
    assert info["available_kv_tokens"] == info["max_total_tokens"]
    assert cache["evictable_tokens"] == cache["cached_tokens"]
