"""OpenAI `tools` / `tool_choice` on /v1/chat/completions: the plan a request's tools make,
and the reading of the output for calls.

Tools are rendered by the model's chat template (`tools=` as in transformers); a template that
ignores them is refused. `tool_choice`:

- `none`: tools are not rendered, the output is plain content.
- `auto`: the model decides; its text is parsed for calls in the template's format
  (`tool_parser.py`).
- `required` / a named function: the output is constrained by a JSON schema grammar, so it is
  always a valid call: an array of `{"name", "arguments"}` objects, or the named function's
  arguments object.

The output is read by a `ToolStreamParser` (`tool_parser.py`) when tools are in play, else by a
`TextReader` (all text is content); a choice that made calls finishes with `tool_calls`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from airserve.srt.constrained.spec import GrammarSpec, check_grammar
from airserve.srt.entrypoints.tool_parser import ToolCall, ToolStreamParser
from airserve.srt.sampling.sampling_params import FieldError
from airserve.srt.tokenizer import Tokenizer

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for function names
_PROBE_NAME = "airserve_probe_tool_7f3a"  # a name no template writes by itself
ANY_OBJECT = {"type": "object"}


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools do: the template's `tools`, the constraint, how to read output.

    `mode`: "auto" (parse the text), "required" (the output is a JSON array of calls),
    "named" (the output is `name`'s arguments object)."""

    tools: list[dict]  # as the template receives them
    names: tuple[str, ...]
    mode: str
    name: str | None = None
    json_schema: str | None = None


def plan_tools(tools: list[Tool] | None, choice: ToolChoice | None,
               parallel: bool | None, tokenizer: Tokenizer) -> ToolPlan | None:
    """Validate the request's tools against `choice`; None when no tool is in play."""
    if not tools:  # "none" and "auto" ask for nothing then (clients send them by default)
        if choice is not None and choice not in ("none", "auto"):
            raise FieldError("tool_choice", "needs `tools`: no tool was given")
        return None
    check_tools(tools)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None
    check_template_supports_tools(tokenizer)
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    names = tuple(t.function.name for t in tools)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise FieldError("tool_choice.function.name",
                             f"{name!r} is not one of the tools: {', '.join(names)}")
        params = next(t.function.parameters for t in tools if t.function.name == name)
        return ToolPlan(rendered, names, "named", name, json.dumps(params or ANY_OBJECT))
    if choice == "required":
        return ToolPlan(rendered, names, "required",
                        json_schema=json.dumps(calls_schema(tools, parallel)))
    return ToolPlan(rendered, names, "auto")


def check_tools(tools: list[Tool]) -> None:
    """Names valid and distinct; parameters a JSON schema of an object (FieldError names it)."""
    seen = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if not _NAME.match(fn.name):
            raise FieldError(f"tools.{i}.function.name", "must be 1 to 64 letters, digits, "
                             f"'_', '.' or '-', got {fn.name!r}")
        if fn.name in seen:
            raise FieldError(f"tools.{i}.function.name", f"{fn.name!r} is given twice")
        seen.add(fn.name)
        params = fn.parameters
        if params is None:
            continue
        if params.get("type", "object") != "object":
            raise FieldError(f"tools.{i}.function.parameters",
                             f"must describe an object (type \"object\"), got type "
                             f"{params.get('type')!r}")
        check_grammar(GrammarSpec("json_schema", json.dumps(params)),
                      f"tools.{i}.function.parameters")


def calls_schema(tools: list[Tool], parallel: bool | None) -> dict:
    """A JSON array of one or more calls, each of a given tool with valid arguments."""
    items = [{"type": "object",
              "properties": {"name": {"const": t.function.name},
                             "arguments": t.function.parameters or ANY_OBJECT},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def check_template_supports_tools(tokenizer: Tokenizer) -> None:
    """A template that renders a probe tool's name supports tools; one that ignores `tools`
    would let the model answer blind, so the request is refused."""
    if not tokenizer.chat_template:
        raise FieldError("tools", "the model has no chat template, so it cannot be given tools")
    probe = [{"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                               "parameters": ANY_OBJECT}}]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe)
    except ValueError as e:
        raise FieldError("tools", f"the model's chat template failed to render tools: {e}") \
            from None
    if _PROBE_NAME not in text:
        raise FieldError("tools", "the model's chat template does not support tools (it ignores "
                                  "them); use a model whose template renders `tools`, or "
                                  "describe the functions in the prompt")


def template_message(message: dict) -> dict:
    """A chat message for the template: tool-call arguments as objects (what templates expect
    from transformers), not JSON strings."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except ValueError:
                pass  # the template gets the string as it came
        out.append({**call, "function": fn})
    return {**message, "tool_calls": out}


# The output side.
class TextReader:
    """The plain answer's reader: all text is content (same interface as ToolStreamParser)."""

    def __init__(self) -> None:
        self.sent = 0
        self.calls: list[ToolCall] = []

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        piece, self.sent = text[self.sent:], len(text)
        return piece, []


def output_reader(plan: ToolPlan | None, tool_format: str) -> TextReader | ToolStreamParser:
    """A reader for one choice's cumulative text: `feed(text, finished) -> (new content, new
    calls)`. `tool_format`: how the template writes calls (`tool_parser.template_format`)."""
    if plan is None:
        return TextReader()
    return ToolStreamParser(plan.mode, tool_format, plan.names, plan.name)


def tool_finish_reason(reason: str | None,
                       reader: TextReader | ToolStreamParser) -> str | None:
    """OpenAI's finish_reason: `tool_calls` for a choice that stopped after making calls."""
    return "tool_calls" if reason == "stop" and reader.calls else reason


def chat_message(content: str, calls: list[ToolCall]) -> dict:
    """A non-streamed chat choice's `message`: content null when calls alone answer."""
    message: dict = {"role": "assistant", "content": content or None if calls else content}
    if calls:
        message["tool_calls"] = [c.to_dict() for c in calls]
    return message
