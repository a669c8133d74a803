"""OpenAI tools through the official client, against a real server on a tiny Qwen2 model whose
chat template (written for the tests, Hermes/Qwen2.5 layout) renders tools; a few on a tiny
Llama whose template writes calls as Llama 3 JSON.

A random-weight model never calls a tool by itself, so `auto` is exercised with an SGLang
`regex` that makes it write a Hermes call: the parsing is what is tested. `required` and named
functions are constrained by the server's own grammar.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from airserve_testing.server_utils import ServerProcess
from airserve_testing.tool_templates import (
    HERMES_TEMPLATE,
    LLAMA3_JSON_TEMPLATE,
    with_chat_template,
)

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
FORCED_CALL = (r'On it\. <tool_call>\{"name": "get_weather", "arguments": '
               r'\{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>')


@pytest.fixture(scope="module")
def tool_server(tiny_qwen2_dir, tmp_path_factory):
    path = with_chat_template(tiny_qwen2_dir, str(tmp_path_factory.mktemp("tools") / "m"),
                              HERMES_TEMPLATE)
    srv = ServerProcess(path, "--max-total-tokens", "8192").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key=tool_server.api_key,
                         max_retries=0)


def chat(client, stream: bool = False, **kwargs):
    kwargs = {"model": "default", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 400,
              "temperature": 0.9, "seed": 3, **kwargs}
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0]
    return collect(client.chat.completions.create(**kwargs, stream=True))


def collect(chunks) -> dict:
    """A streamed choice put together as a client would: content, calls by index, reason."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        c = chunk.choices[0]
        content += c.delta.content or ""
        for call in c.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        reason = c.finish_reason or reason
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "reason": reason}


def calls_of(choice) -> tuple[str | None, list[tuple[str, dict]], str]:
    if isinstance(choice, dict):
        return (choice["content"] or None,
                [(c["name"], json.loads(c["arguments"])) for c in choice["calls"]],
                choice["reason"])
    calls = choice.message.tool_calls or []
    return (choice.message.content,
            [(c.function.name, json.loads(c.function.arguments)) for c in calls],
            choice.finish_reason)


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_is_a_valid_call(client, stream):
    choice = chat(client, stream, tool_choice={"type": "function",
                                               "function": {"name": "add"}})
    content, calls, reason = calls_of(choice)
    assert reason == "tool_calls" and content is None
    assert [name for name, _ in calls] == ["add"]
    jsonschema.validate(calls[0][1], ADD)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0, 0.9])
def test_required_gives_valid_calls(client, stream, temperature):
    choice = chat(client, stream, tool_choice="required", parallel_tool_calls=False,
                  temperature=temperature)
    content, calls, reason = calls_of(choice)
    assert reason == "tool_calls" and content is None and len(calls) == 1
    name, args = calls[0]
    jsonschema.validate(args, SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_hermes_call_and_keeps_the_content(client, stream):
    choice = chat(client, stream, tool_choice="auto", extra_body={"regex": FORCED_CALL})
    content, calls, reason = calls_of(choice)
    assert content == "On it." and reason == "tool_calls"
    assert [name for name, _ in calls] == ["get_weather"]
    jsonschema.validate(calls[0][1], WEATHER)
    if stream:
        assert choice["calls"][0]["id"].startswith("call_")


def test_auto_without_a_call_is_content(client):
    choice = chat(client, max_tokens=20, temperature=0)
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str)


def test_none_does_not_render_the_tools(client):
    with_tools = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS,
                                                max_tokens=1)
    without = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS,
                                             tool_choice="none", max_tokens=1)
    assert without.usage.prompt_tokens < with_tools.usage.prompt_tokens
    assert without.choices[0].message.tool_calls is None


def test_a_conversation_with_earlier_calls_renders(client):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="default", messages=messages, tools=TOOLS,
                                       max_tokens=2)
    plain = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS,
                                           max_tokens=2)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 10


@pytest.mark.parametrize("tools,choice,field", [
    ([{"type": "function", "function": {"parameters": WEATHER}}], None, "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": 5}}], None,
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "bogus"}}}}}], None,
     "tools.0.function.parameters"),
    ([{"type": "retrieval", "function": {"name": "f"}}], None, "tools.0.type"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice.function.name"),
    (None, "required", "tool_choice"),
])
def test_invalid_tools_are_400s(tool_server, tools, choice, field):
    body = {"messages": MESSAGES, "max_tokens": 2}
    if tools is not None:
        body["tools"] = tools
    if choice is not None:
        body["tool_choice"] = choice
    with tool_server.client() as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"], r.text


def test_tools_and_response_format_together_is_a_400(tool_server):
    with tool_server.client() as http:
        r = http.post("/v1/chat/completions", json={
            "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
            "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "only one constraint" in r.text, r.text


def test_template_without_tool_support_is_a_400(server):
    """The session server's tiny model has a chat template that ignores `tools`."""
    with server.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 400, r.text
    assert "does not support tools" in r.json()["error"]["message"]


# Llama 3 JSON calls: the whole answer is {"name": ..., "parameters": {...}}.
LLAMA_CALL = (r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome)", '
              r'"days": [1-7]\}\}')


@pytest.fixture(scope="module")
def llama_client(tiny_llama_dir, tmp_path_factory):
    path = with_chat_template(tiny_llama_dir, str(tmp_path_factory.mktemp("llama3") / "m"),
                              LLAMA3_JSON_TEMPLATE)
    srv = ServerProcess(path, "--max-total-tokens", "8192").wait_ready()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.api_key, max_retries=0)
    assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("stream", [False, True])
def test_llama3_json_call_is_parsed(llama_client, stream):
    choice = chat(llama_client, stream, extra_body={"regex": LLAMA_CALL})
    content, calls, reason = calls_of(choice)
    assert content is None and reason == "tool_calls"
    assert [name for name, _ in calls] == ["get_weather"]
    jsonschema.validate(calls[0][1], WEATHER)


def test_llama3_required_and_plain_answers(llama_client):
    content, calls, reason = calls_of(chat(llama_client, tool_choice="required",
                                           parallel_tool_calls=False))
    assert reason == "tool_calls" and len(calls) == 1
    jsonschema.validate(calls[0][1], SCHEMAS[calls[0][0]])
    plain = chat(llama_client, True, extra_body={"regex": "Sunny, [1-9] days."})
    assert calls_of(plain)[:2] == (plain["content"], []) and plain["content"].startswith("Sunny")
