"""Tool calls read back from text (Hermes/Qwen and Llama 3 JSON formats), whole and streamed
one character at a time; tool definitions checked; templates with and without tool support."""

from __future__ import annotations

import json

import pytest

from airserve.srt.entrypoints.tool_calls import (
    NamedToolChoice,
    Tool,
    check_template_supports_tools,
    plan_tools,
)
from airserve.srt.entrypoints.tool_parser import (
    ToolStreamParser,
    parse_tool_calls,
    template_format,
)
from airserve.srt.sampling.sampling_params import FieldError
from airserve.srt.tokenizer import Tokenizer, get_tokenizer
from airserve_testing.tiny_models import CHAT_TEMPLATE, build_tokenizer
from airserve_testing.tool_templates import HERMES_TEMPLATE, LLAMA3_JSON_TEMPLATE

NAMES = ("get_weather", "add")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}'


def tokenizer(template: str | None) -> Tokenizer:
    return Tokenizer(build_tokenizer(300), bos_token_id=None, eos_token_ids=[0],
                     add_bos_token=False, chat_template=template, path="tiny")


def test_formats_follow_the_template():
    assert template_format(HERMES_TEMPLATE) == "hermes"
    assert template_format(LLAMA3_JSON_TEMPLATE) == "json"


def test_hermes_calls_and_content():
    content, calls = parse_tool_calls(HERMES, "hermes", NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2 and calls[0].id.startswith("call_")
    # Unclosed last call (the model stopped at EOS): still a call.
    _, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}', "hermes",
                                NAMES)
    assert [c.name for c in calls] == ["add"]


@pytest.mark.parametrize("text", [
    "no call here",
    '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',  # not one of the tools
    '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "add", "arguments": {"a": </tool_call>',  # cut short
])
def test_hermes_non_calls_stay_content(text):
    assert parse_tool_calls(text, "hermes", NAMES) == (text, [])


def test_llama3_json_calls():
    _, calls = parse_tool_calls(LLAMA, "json", NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                   {"city": "Rome"})]
    two = '{"name": "add", "arguments": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}'
    assert [json.loads(c.arguments) for c in parse_tool_calls(two, "json", NAMES)[1]] == [
        {"a": 1}, {"a": 2}]
    assert parse_tool_calls("Rome is sunny.", "json", NAMES) == ("Rome is sunny.", [])
    assert parse_tool_calls('{"name": "nope"}', "json", NAMES)[1] == []


@pytest.mark.parametrize("text,fmt", [(HERMES, "hermes"), (LLAMA, "json"),
                                      ("Plain <tool answer> text", "hermes"),
                                      ("  Plain answer", "json")])
def test_streaming_one_character_at_a_time_equals_the_whole(text, fmt):
    whole_content, whole_calls = parse_tool_calls(text, fmt, NAMES)
    parser = ToolStreamParser("auto", fmt, NAMES)
    content, calls = "", []
    for i in range(1, len(text) + 1):
        piece, new = parser.feed(text[:i], i == len(text))
        content += piece
        calls += new
        assert "<tool_call>" not in content and "{" not in content or not whole_calls
    assert content.rstrip() == whole_content.rstrip()
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments)
                                                      for c in whole_calls]


def test_plan_checks_tools_and_choice():
    tok = tokenizer(HERMES_TEMPLATE)
    tools = [Tool.model_validate(WEATHER)]
    assert plan_tools(tools, "none", None, tok) is None
    auto = plan_tools(tools, None, None, tok)
    assert auto.mode == "auto" and auto.json_schema is None
    named = plan_tools(tools, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_weather"}}), None, tok)
    assert named.mode == "named" and json.loads(named.json_schema)["required"] == ["city"]
    required = json.loads(plan_tools(tools, "required", False, tok).json_schema)
    assert required["maxItems"] == 1 and required["minItems"] == 1


@pytest.mark.parametrize("tools,choice,field", [
    ([], "required", "tool_choice"),
    ([{**WEATHER, "function": {"name": "bad name!"}}], None, "tools.0.function.name"),
    ([WEATHER, WEATHER], None, "tools.1.function.name"),
    ([{**WEATHER, "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "tools.0.function.parameters"),
    ([{**WEATHER, "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}], None,
     "tools.0.function.parameters"),
])
def test_bad_tools_name_the_field(tools, choice, field):
    with pytest.raises(FieldError) as e:
        plan_tools([Tool.model_validate(t) for t in tools], choice, None,
                   tokenizer(HERMES_TEMPLATE))
    assert e.value.field == field


def test_templates_without_tool_support_are_refused():
    with pytest.raises(FieldError, match="does not support tools"):
        check_template_supports_tools(tokenizer(CHAT_TEMPLATE))
    with pytest.raises(FieldError, match="no chat template"):
        check_template_supports_tools(tokenizer(None))
    check_template_supports_tools(tokenizer(LLAMA3_JSON_TEMPLATE))


def test_default_model_template_has_no_tool_support():
    """SmolLM2-135M-Instruct's template (the default model) ignores `tools`: refused."""
    with pytest.raises(FieldError, match="does not support tools"):
        check_template_supports_tools(get_tokenizer(None))
