"""OpenAI request bodies for `/v1/completions` and `/v1/chat/completions`, as pydantic models.

Strict types and finite numbers; fields airserve does not implement are refused when set
(`OPENAI_NOT_IMPLEMENTED`), other unknown fields (client bookkeeping such as `user`) are
ignored, as SGLang does. A bad field is a 400 naming it by its path.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from airserve.srt.entrypoints.structured_output import ResponseFormat
from airserve.srt.entrypoints.tool_calls import Tool, ToolChoice
from airserve.srt.managers.tokenizer_manager import RequestError
from airserve.srt.managers.validation import (
    MAX_SAMPLES,
    MAX_TOP_LOGPROBS,
    OPENAI_NOT_IMPLEMENTED,
    refuse_not_implemented,
)
from airserve.srt.sampling.sampling_params import INT32_MAX

MAX_CHOICES = MAX_SAMPLES  # n above this is refused, not queued

# What a wrongly typed field should have been, for error messages.
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of such lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    skip_special_tokens: bool = True
    logit_bias: dict[str, int | float] | None = None
    # Structured output: at most one of these (SGLang's regex / ebnf extensions included).
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    data_parallel_rank: int | None = Field(None, ge=0)  # SGLang's: send it to that replica


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None


def parse_request(model: type[StrictModel], body: dict) -> StrictModel:
    """`body` as `model`; RequestError(400) naming every bad field."""
    refuse_not_implemented(body, OPENAI_NOT_IMPLEMENTED)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestError(400, format_validation_error(e, body)) from None


def format_validation_error(error: ValidationError, body: dict) -> str:
    """One line per bad field, named by its path (`messages.0.role: ...`)."""
    by_field: dict[str, list[str]] = {}
    for e in error.errors():
        path: list[str] = []
        for part in e["loc"]:
            if isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool")):
                break  # a union member's tag, not a field
            path.append(str(part))
        by_field.setdefault(".".join(path) or "body", []).append(e["msg"])
    lines = []
    for name, msgs in by_field.items():
        leaf = name.rsplit(".", 1)[-1]
        if len(msgs) > 1 and leaf in _EXPECTED:
            lines.append(f"{name}: must be {_EXPECTED[leaf]}")
        else:
            lines.append(f"{name}: {msgs[0]}")
    return "; ".join(lines)
