"""SGLang's native API and the server's info endpoints, over plain HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import re

import httpx
import pytest

PROMPTS = [
    "The quick brown fox",
    "Question: Natalia sold clips",
    "airserve captures the decode step",
    "Héllo wörld 你好",
]
GREEDY = {"temperature": 0, "max_new_tokens": 24}


def generate(http, **body) -> httpx.Response:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(response: httpx.Response) -> list:
    """Parses a stream strictly: only `data: ...` lines, each followed by a blank line."""
    lines = "".join(response.iter_text()).split("\n")
    assert lines[-2:] == ["", ""] or lines[-1] == "", lines[-3:]
    events = []
    body = lines[:-1] if lines[-1] == "" else lines
    for i in range(0, len(body), 2):
        assert body[i].startswith("data: "), body[i]
        assert body[i + 1] == "", f"no blank line after {body[i]!r}"
        payload = body[i][len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_generate_single_list_and_input_ids(http, server):
    one = generate(http, text=PROMPTS[0], sampling_params=GREEDY)
    assert set(one) >= {"text", "output_ids", "meta_info"}
    meta = one["meta_info"]
    assert meta["completion_tokens"] == len(one["output_ids"]) <= 24
    assert meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0
    assert meta["finish_reason"]["type"] in ("stop", "length")

    many = generate(http, text=PROMPTS[:2], sampling_params=GREEDY)
    assert isinstance(many, list) and many[0]["output_ids"] == one["output_ids"]

    ids = http.get("/get_model_info").json()
    assert ids["model_path"] and ids["tokenizer_path"]
    by_ids = generate(http, input_ids=[5, 6, 7, 8], sampling_params=GREEDY)
    assert by_ids["meta_info"]["prompt_tokens"] == 4
    both = generate(http, input_ids=[[5, 6, 7, 8], [9, 10]], sampling_params=[GREEDY, GREEDY])
    assert both[0]["output_ids"] == by_ids["output_ids"]


def test_generate_stream_format(http):
    body = {"text": PROMPTS[1], "sampling_params": {**GREEDY, "ignore_eos": True},
            "stream": True}
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    events = events[:-1]
    texts = [e["text"] for e in events]
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "text must be cumulative"
    assert counts == sorted(counts) and counts[-1] == 24
    assert all(e["meta_info"]["prompt_tokens"] > 0 for e in events)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    full = generate(http, text=PROMPTS[1], sampling_params={**GREEDY, "ignore_eos": True})
    assert texts[-1] == full["text"]


def test_generate_ignores_sglang_client_fields(http):
    out = generate(http, text="Hello", sampling_params={
        "max_new_tokens": 5, "temperature": 0, "top_k": -1, "stop_token_ids": [],
        "regex": None, "json_schema": None, "stop_regex": None, "ignore_eos": True,
    }, lora_path=None, return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
        custom_labels=None, stream=False)
    assert out["meta_info"]["completion_tokens"] == 5


def test_generate_max_new_tokens_zero(http):
    out = generate(http, text="A shared prefix", sampling_params={"max_new_tokens": 0})
    assert out["text"] == "" and out["meta_info"]["completion_tokens"] == 0


def test_greedy_equals_offline_engine(http, tiny_llama_dir):
    from airserve import Engine

    engine = Engine(model_path=tiny_llama_dir, max_total_tokens=4096, num_threads=1)
    want = engine.generate(PROMPTS, dict(GREEDY))
    got = generate(http, text=PROMPTS, sampling_params=GREEDY)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["text"] for g in got] == [w["text"] for w in want]


def test_concurrent_requests_equal_sequential(server):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(16)]
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    with server.client() as http:
        sequential = [generate(http, text=p, sampling_params=params)["output_ids"]
                      for p in prompts]

    async def run_all():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers,
                                     timeout=60) as client:
            async def one(i: int, p: str):
                body = {"text": p, "sampling_params": params, "stream": i % 2 == 0}
                r = await client.post("/generate", json=body)
                assert r.status_code == 200, r.text
                if i % 2:
                    return r.json()["output_ids"]
                last = [ln for ln in r.text.split("\n") if ln.startswith("data: {")][-1]
                return json.loads(last[len("data: "):])["output_ids"]
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    assert asyncio.run(run_all()) == sequential


def test_info_endpoints(http, server, tiny_llama_dir):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["model_path"] == tiny_llama_dir == info["tokenizer_path"]
    models = http.get("/v1/models").json()
    # The served name defaults to the model's directory name, never the local path.
    assert models["data"][0]["id"] == os.path.basename(tiny_llama_dir) == info["served_model_name"]
    s = http.get("/get_server_info").json()
    assert s["server_args"]["max_total_tokens"] == 16384 and "api_key" not in s["server_args"]
    assert s["device"] == "cpu" and s["runner"] == "eager"
    assert s["max_total_tokens"] == 16384 and s["context_length"] == 512
    assert s["eager_fallbacks"] == {} and "graph_replays" in s["stats"]
    # Found once at start-up by airserve.devices.discover().
    torch_devices = {d["name"]: d for d in s["devices"]["torch"]["devices"]}
    assert torch_devices["cpu"]["available"]
    # A safetensors model: float32 weights, no packed layers; C++ decode attention on cpu.
    kernels = s["decode_kernels"]
    assert kernels["packed_layers"] == {} and kernels["packed_decode_max_bs"] == 0
    assert kernels["cpp_decode_attention"] is True and kernels["linear_layers"] > 0
    from airserve.srt.layers.attention.torch_native_backend import attention_isas

    assert kernels["decode_attention_isa"] == attention_isas()[0]  # the best this CPU has
    r = http.post("/flush_cache")
    assert r.status_code == 200 and "flushed" in r.text


def test_metrics(http):
    generate(http, text="Hello", sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    text = http.get("/metrics").text
    for name in ("airserve:num_requests_total", "airserve:prompt_tokens_total",
                 "airserve:generation_tokens_total", "airserve:num_running_reqs",
                 "airserve:num_queue_reqs", "airserve:token_usage",
                 "airserve:graph_replays_total", "airserve:eager_fallbacks",
                 "airserve:time_to_first_token_seconds_bucket",
                 "airserve:inter_token_latency_seconds_bucket",
                 "airserve:e2e_request_latency_seconds_count"):
        assert name in text, name


@pytest.mark.parametrize("path,status", [("/health", 200), ("/metrics", 401)])
def test_only_health_needs_no_api_key(server, path, status):
    assert httpx.get(server.url + path).status_code == status
    assert httpx.get(server.url + path, headers=server.headers).status_code == 200


def test_prefix_cache_hits_are_reported(http):
    """A repeated prompt reuses its whole pages short of its last token; /get_server_info and
    /metrics show the cache; /flush_cache empties it."""
    prompt = "Radix caching test: " + " ".join(f"w{i}" for i in range(40))
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    first = generate(http, text=prompt, sampling_params=params)
    second = generate(http, text=prompt, sampling_params=params)
    n = first["meta_info"]["prompt_tokens"]
    page = http.get("/get_server_info").json()["kv_pool"]["page_size"]
    reused = (n - 1) // page * page  # the last token is always prefilled (its logits)
    assert first["meta_info"]["cached_tokens"] < reused  # only what earlier tests left
    assert second["meta_info"]["cached_tokens"] == reused
    assert second["output_ids"] == first["output_ids"]
    cache = http.get("/get_server_info").json()["stats"]["prefix_cache"]
    # The tree holds the prompt and output (n + 8 tokens, the last not yet in the cache) in
    # whole pages.
    assert cache["enabled"] and cache["cached_tokens"] >= (n + 7) // page * page
    assert cache["hit_rate"] > 0
    text = http.get("/metrics").text
    for name in ("airserve:cache_hit_rate", "airserve:radix_cache_tokens",
                 "airserve:radix_cache_evicted_tokens_total", "airserve:mixed_steps_total"):
        assert name in text, name
    assert http.post("/flush_cache").status_code == 200
    third = generate(http, text=prompt, sampling_params=params)
    assert third["meta_info"]["cached_tokens"] == 0 and third["output_ids"] == first["output_ids"]


def test_prefill_budget_while_decoding_is_reported(server, http):
    """A long prompt that arrives while a stream decodes is read at most the decode budget per
    step (the test server's --decode-chunked-prefill-size), a decode step between two of its
    chunks; the output is the one it gets alone; /get_server_info and /metrics show the budget
    and the counts."""
    prompt = [5 + i % 290 for i in range(300)]  # three chunks of the budget of 128
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    alone = generate(http, input_ids=prompt, sampling_params=params)["output_ids"]
    assert http.post("/flush_cache").status_code == 200
    before = http.get("/get_server_info").json()["stats"]
    assert before["decode_chunked_prefill_size"] == 128
    stream_body = {"input_ids": [7, 8, 9], "stream": True,
                   "sampling_params": {"temperature": 0, "max_new_tokens": 400,
                                       "ignore_eos": True}}
    with server.client() as other, other.stream("POST", "/generate", json=stream_body) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):  # the stream decodes now
            pass
        out = generate(http, input_ids=prompt, sampling_params=params)
        for _ in lines:  # let the stream finish
            pass
    assert out["output_ids"] == alone
    after = http.get("/get_server_info").json()["stats"]
    assert after["prefill_budget_limited_steps"] - before["prefill_budget_limited_steps"] >= 2
    assert after["interleaved_decode_steps"] - before["interleaved_decode_steps"] >= 2
    text = http.get("/metrics").text
    assert re.search(r"^airserve:decode_chunked_prefill_size\{[^}]*\} 128\.0$", text, re.M)
    for name in ("airserve:prefill_budget_limited_steps_total",
                 "airserve:interleaved_decode_steps_total"):
        assert name in text, name
