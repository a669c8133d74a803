"""Structured output over HTTP on the tiny random model: native json_schema / regex / ebnf and
OpenAI response_format; every output validates, bad grammars are 400s naming the field.

The session server (conftest) runs eager; the CPU graph runner with grammars is covered in
test/srt/constrained/test_grammar_engine.py.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

GEN = "/generate"
PROMPTS = ["Hello", "The quick brown fox", "Question: Natalia sold", "12345 + 678 ="]
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"enum": ["Ann", "Bob", "Eve"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"}},
        "required": ["name", "age", "member"], "additionalProperties": False},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
               "minItems": 1, "maxItems": 3},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]},
                      "maxItems": 2}},
            "required": ["id", "roles"], "additionalProperties": False},
        "active": {"type": "boolean"}, "ratio": {"type": "number", "minimum": 0,
                                                 "maximum": 1}},
        "required": ["user", "active"], "additionalProperties": False},
    "code": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "note": {"type": ["string", "null"], "pattern": "^[a-z ]{0,12}$"}},
        "required": ["code", "note"], "additionalProperties": False},
}
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe), (because|since) [a-z]{2,8}\.",
           r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"]
MODES = [(0, False), (0, True), (0.9, False), (0.9, True)]  # (temperature, stream)


def generate(http: httpx.Client, params: dict, stream: bool) -> list[dict]:
    """One /generate call over PROMPTS; the final output of each, streamed or not."""
    body = {"text": PROMPTS, "stream": stream,
            "sampling_params": {"max_new_tokens": 400, "seed": 11, **params}}
    if not stream:
        r = http.post(GEN, json=body)
        assert r.status_code == 200, r.text
        return r.json()
    final: dict[int, dict] = {}
    with http.stream("POST", GEN, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                final[event["index"]] = event
    return [final[i] for i in range(len(PROMPTS))]


def assert_stopped(out: dict) -> str:
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    return out["text"]


# Each schema greedy and sampled; streamed or not alternates, so every mode meets two schemas.
JSON_CASES = [(name, *MODES[(i + j) % 2 + 2 * j]) for i, name in enumerate(sorted(SCHEMAS))
              for j in (0, 1)]


@pytest.mark.parametrize("name,temperature,stream", JSON_CASES)
def test_json_schema_outputs_validate(http, name, temperature, stream):
    outs = generate(http, {"json_schema": json.dumps(SCHEMAS[name]),
                           "temperature": temperature}, stream)
    for out in outs:  # 4 schemas x 2 modes x 4 prompts: 32 generations
        jsonschema.validate(json.loads(assert_stopped(out)), SCHEMAS[name])


@pytest.mark.parametrize("temperature,stream", MODES)
def test_regex_outputs_match(http, temperature, stream):
    for pattern in REGEXES:  # 3 regexes x 4 modes x 4 prompts: 48 generations
        for out in generate(http, {"regex": pattern, "temperature": temperature}, stream):
            assert re.fullmatch(pattern, assert_stopped(out)), out["text"]


def test_ebnf_output_matches(http):
    ebnf = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    for out in generate(http, {"ebnf": ebnf, "temperature": 0.9}, False):
        assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", assert_stopped(out))


def test_unconstrained_output_does_not_follow_the_schema(http):
    """The constraint is what makes the outputs valid: the same prompts without it are not."""
    for out in generate(http, {"temperature": 0, "max_new_tokens": 60}, False):
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(out["text"]), SCHEMAS["nested"])


def test_stop_string_cuts_a_constrained_output(http):
    r = http.post(GEN, json={"text": "Hi", "sampling_params": {
        "regex": "[0-9]{3}-STOP-[0-9]{3}", "stop": "-STOP", "max_new_tokens": 40}})
    out = r.json()
    assert re.fullmatch("[0-9]{3}", out["text"]), out
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "-STOP"}


def test_aborted_stream_leaves_the_server_clean(http, server):
    body = {"text": "Hello", "stream": True, "sampling_params": {
        "regex": "[a-z ]{300,400}", "max_new_tokens": 400, "temperature": 0.9}}
    with http.stream("POST", GEN, json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break  # closing the stream aborts the request
    out = generate(http, {"regex": REGEXES[0]}, False)
    assert all(re.fullmatch(REGEXES[0], o["text"]) for o in out)
    info = http.get("/get_server_info").json()
    assert info["stats"]["num_running_reqs"] == 0
    assert info["grammar_backend"]["compiled"] >= 1 and info["grammar_backend"]["cached"] >= 1


@pytest.mark.parametrize("params,field,message", [
    ({"json_schema": "{"}, "sampling_params.json_schema", "cannot be compiled"),
    ({"json_schema": '{"type": "no-such-type"}'}, "sampling_params.json_schema",
     "no-such-type"),
    ({"regex": "(ab"}, "sampling_params.regex", "parenthesis"),
    ({"ebnf": "root ::= missing"}, "sampling_params.ebnf", "missing"),
    ({"json_schema": {"type": "object"}}, "sampling_params.json_schema", "string"),
    ({"regex": "a", "json_schema": "{}"}, "sampling_params.regex", "only one constraint"),
])
def test_bad_grammar_is_a_400_naming_the_field(http, params, field, message):
    r = http.post(GEN, json={"text": "x", "sampling_params": params})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"] and message in r.json()["error"]["message"]


# OpenAI response_format.
@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format_json_schema(client, stream):
    kwargs = dict(model="default", messages=[{"role": "user", "content": "Who?"}],
                  max_tokens=400, temperature=0.9, seed=5, n=2,
                  response_format=schema_format("person"))
    if not stream:
        texts = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    else:
        parts = ["", ""]
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            c = chunk.choices[0]
            parts[c.index] += c.delta.content or ""
        texts = parts
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS["person"])


def test_completion_response_format_and_json_object(client):
    r = client.completions.create(model="default", prompt="Scores:", max_tokens=400,
                                  temperature=0, extra_body={
                                      "response_format": schema_format("scores")})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["scores"])
    r = client.chat.completions.create(model="default", max_tokens=400, temperature=0,
                                       messages=[{"role": "user", "content": "JSON please"}],
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,field", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex"),
])
def test_bad_response_format_is_a_400(http, body, field):
    for path, base in (("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/completions", {"prompt": "x"})):
        r = http.post(path, json={**base, "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        assert field in r.json()["error"]["message"], r.text
