"""The OpenAI API through the official `openai` client, against the real server."""

from __future__ import annotations

import os

import openai
import pytest


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def native(http, prompt: str, **params) -> dict:
    r = http.post("/generate", json={"text": prompt, "sampling_params": params})
    assert r.status_code == 200, r.text
    return r.json()


def test_models_lists_the_served_name(client, tiny_llama_dir):
    assert [m.id for m in client.models.list().data] == [os.path.basename(tiny_llama_dir)]
    r = client.completions.create(model=tiny_llama_dir, prompt="x", max_tokens=1)  # an alias
    assert r.model == os.path.basename(tiny_llama_dir)


def test_completion_equals_native_generate(client, model, http):
    r = client.completions.create(model=model, prompt="The quick brown", max_tokens=12,
                                  temperature=0)
    ref = native(http, "The quick brown", max_new_tokens=12, temperature=0)
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason == ref["meta_info"]["finish_reason"]["type"]
    assert r.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")


def test_completion_stream_every_chunk_has_a_choice(client, model):
    kwargs = dict(model=model, prompt="airserve captures", max_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(len(c.choices) >= 1 for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == \
        ["length"]
    assert chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_accepts_sglang_client_fields(client):
    r = client.completions.create(model="default", prompt="Hello", max_tokens=4, temperature=0,
                                  best_of=1, seed=3, top_p=1.0,
                                  extra_body={"ignore_eos": True, "top_k": -1,
                                              "regex": None})
    assert r.usage.completion_tokens == 4


def test_completion_list_prompt_and_n(client, model):
    r = client.completions.create(model=model, prompt=["Hello", "The quick"], n=2,
                                  max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    # Greedy: the two choices for one prompt agree.
    assert r.choices[0].text == r.choices[1].text
    assert r.choices[2].text == r.choices[3].text


def test_completion_stop_string_is_trimmed(client, model, http):
    full = native(http, "The quick brown", max_new_tokens=24, temperature=0,
                  ignore_eos=True)["text"]
    stops = [full[i:i + 2] for i in range(4, len(full) - 2)
             if full[i:i + 2].isascii() and full[i:i + 2].isprintable()]
    if not stops:
        pytest.skip("the random model produced no printable ASCII pair to stop at")
    stop = stops[0]
    r = client.completions.create(model=model, prompt="The quick brown", max_tokens=24,
                                  temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_chat_and_chat_stream_agree(client, model):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "Question: 48 clips?"}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                          temperature=0)
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_content_parts_and_max_completion_tokens(client, model):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_client_errors(server, model):
    bad_key = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        bad_key.models.list()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt="x", max_tokens=2, temperature=-1)


def test_usage_reports_cached_prompt_tokens(client, model):
    prompt = "OpenAI cached tokens: " + " ".join(f"t{i}" for i in range(30))
    first = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert second.choices[0].text == first.choices[0].text
