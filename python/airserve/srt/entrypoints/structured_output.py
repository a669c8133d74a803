"""Structured output on the OpenAI routes: `response_format` and SGLang's `regex` / `ebnf`,
turned into the one grammar field of the request's sampling parameters."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from airserve.srt.constrained.spec import GrammarSpec, check_grammar
from airserve.srt.entrypoints.tool_calls import ToolPlan
from airserve.srt.sampling.sampling_params import FieldError

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def grammar_fields(req, plan: ToolPlan | None) -> dict:
    """The one grammar of an OpenAI request (`response_format`, `regex`, `ebnf`, or the tools'
    `required` / named constraint) as sampling fields, parsed (a 400 names the field)."""
    given: dict[str, tuple[str, str]] = {}  # request field -> (sampling field, source)
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        if fmt.type == "json_schema" and schema is None:
            raise FieldError("response_format.json_schema.schema",
                             "is required when response_format.type is json_schema")
        field = "response_format.json_schema.schema" if schema is not None \
            else "response_format"
        given[field] = ("json_schema", json.dumps(schema if schema is not None
                                                  else {"type": "object"}))
    if plan is not None and plan.json_schema is not None:
        given["tool_choice"] = ("json_schema", plan.json_schema)
    for name in ("regex", "ebnf"):
        if getattr(req, name) is not None:
            given[name] = (name, getattr(req, name))
    if len(given) > 1:
        raise FieldError(list(given)[1], "only one constraint per request: "
                         + " and ".join(given) + " are all set")
    for field, (kind, text) in given.items():
        check_grammar(GrammarSpec(kind, text), field)
    return {kind: text for kind, text in given.values()}
