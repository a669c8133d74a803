"""OpenAI-compatible `/v1/completions` and `/v1/chat/completions`: protocol and adapters.

Requests are validated with pydantic (strict types; unknown fields ignored, as SGLang does),
turned into one airserve request per (prompt, choice), and the outputs are shaped into
OpenAI's responses or SSE chunks. Every streamed chunk carries a non-empty `choices[0]`
(SGLang's and vLLM's benchmark clients index it unconditionally), the usage chunk included.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from airserve.srt.entrypoints.http_utils import (
    final_outputs,
    read_json_object,
    sse,
    stream_response,
)
from airserve.srt.managers.tokenizer_manager import ReqOutput, RequestError, TokenizerManager
from airserve.srt.sampling.sampling_params import SamplingParams

MAX_CHOICES = 64  # n above this is refused, not queued

# What a wrongly typed field should have been, for error messages.
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of such lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
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
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    logit_bias: dict | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    best_of: int | None = Field(None, ge=1)  # accepted (SGLang's client sends 1); not used
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    tools: list | None = None
    response_format: dict | None = None


def parse_request(model: type[_Strict], body: dict) -> _Strict:
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise RequestError(400, format_validation_error(e, body)) from None
    unsupported = []
    if getattr(req, "logprobs", None) not in (None, False):
        unsupported.append("logprobs")
    if getattr(req, "echo", False):
        unsupported.append("echo")
    if getattr(req, "suffix", None) is not None:
        unsupported.append("suffix")
    if getattr(req, "tools", None):
        unsupported.append("tools")
    if req.logit_bias:
        unsupported.append("logit_bias")
    fmt = getattr(req, "response_format", None)
    if fmt and fmt.get("type", "text") != "text":
        unsupported.append("response_format")
    if unsupported:
        raise RequestError(400, f"{', '.join(unsupported)}: not supported by airserve; "
                                "leave it out of the request")
    return req


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


# Requests -> airserve requests.
def sampling_params(req: _SamplingFields, max_new_tokens: int, choice: int) -> dict:
    """SGLang-named sampling parameters, validated (ValueError -> 400 names the field)."""
    params = {
        "max_new_tokens": max_new_tokens, "min_new_tokens": req.min_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "min_p": req.min_p, "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty, "repetition_penalty": req.repetition_penalty,
        "stop": req.stop, "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        # n choices with one seed would all be equal; offset it per choice.
        "seed": None if req.seed is None else req.seed + choice,
    }
    params = {k: v for k, v in params.items() if v is not None}
    try:
        SamplingParams.from_dict(params)
    except (ValueError, TypeError) as e:
        raise RequestError(400, str(e)) from None
    return params


def completion_prompts(req: CompletionRequest, manager: TokenizerManager) -> list[list[int]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        return [manager.tokenizer.encode(prompt)]
    if not prompt:
        raise RequestError(400, "prompt: must not be an empty list")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [manager.tokenizer.encode(p) for p in prompt]
    return [list(p) for p in prompt]


def chat_prompt(req: ChatCompletionRequest, manager: TokenizerManager) -> list[int]:
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            bad = [p.type for p in content if p.type != "text"]
            if bad:
                raise RequestError(400, f"messages.{i}.content: only text parts are supported, "
                                        f"got {', '.join(bad)}")
            content = "".join(p.text or "" for p in content)
        messages.append({"role": m.role, "content": content or ""})
    try:
        text = manager.tokenizer.apply_chat_template(messages)
    except ValueError as e:
        raise RequestError(400, str(e)) from None
    return manager.tokenizer.encode(text)


def resolve_model(req: _SamplingFields, names: tuple[str, ...]) -> str:
    if req.model is None or req.model in names:
        return names[0]
    raise RequestError(404, f"model {req.model!r} does not exist; this server serves "
                            f"{names[0]!r} (see GET /v1/models)")


# Outputs -> OpenAI shapes.
def finish_reason(out: ReqOutput) -> str | None:
    reason = out.finished_reason
    return None if reason is None else reason["type"]


def usage(outputs: list[ReqOutput], n: int) -> dict:
    prompt = sum(o.prompt_tokens for o in outputs[::n])  # each prompt counts once, not per choice
    completion = sum(o.completion_tokens for o in outputs)
    cached = sum(o.cached_tokens for o in outputs[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class OpenAIServing:
    """The two endpoints; `model_names[0]` is the name responses report."""

    def __init__(self, manager: TokenizerManager, model_names: tuple[str, ...]) -> None:
        self.manager = manager
        self.model_names = model_names

    async def completions(self, request: Request):
        req = parse_request(CompletionRequest, await read_json_object(request))
        model = resolve_model(req, self.model_names)
        prompts = completion_prompts(req, self.manager)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
        return await self._serve(request, req, model, prompts, max_tokens, chat=False)

    async def chat(self, request: Request):
        req = parse_request(ChatCompletionRequest, await read_json_object(request))
        model = resolve_model(req, self.model_names)
        prompt = chat_prompt(req, self.manager)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if max_tokens is None:  # OpenAI's default for chat: up to the context length
            max_tokens = max(self.manager.info["context_length"] - len(prompt), 0)
        return await self._serve(request, req, model, [prompt], max_tokens, chat=True)

    async def _serve(self, request: Request, req: _SamplingFields, model: str,
                     prompts: list[list[int]], max_tokens: int, chat: bool):
        for ids in prompts:
            self.manager.check_request(ids, max_tokens)
        jobs = [(ids, sampling_params(req, max_tokens, c)) for ids in prompts
                for c in range(req.n)]
        streams = [self.manager.generate(ids, p, stream=req.stream) for ids, p in jobs]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if not req.stream:
            outputs = await final_outputs(request, streams)
            return JSONResponse(_response(rid, created, model, outputs, req.n, chat))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await stream_response(request, streams, lambda outputs: _stream_chunks(
            rid, created, model, outputs, len(jobs), req.n, chat, include_usage))


def _response(rid: str, created: int, model: str, outputs: list[ReqOutput], n: int,
              chat: bool) -> dict:
    choices = []
    for i, out in enumerate(outputs):
        choice = {"index": i, "logprobs": None, "finish_reason": finish_reason(out)}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        choices.append(choice)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": choices, "usage": usage(outputs, n)}


def _chunk(rid: str, created: int, model: str, index: int, text: str | None,
           reason: str | None, chat: bool, usage_: dict | None = None,
           role: bool = False) -> bytes:
    choice: dict = {"index": index, "logprobs": None, "finish_reason": reason}
    if chat:
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": model, "choices": [choice], "usage": usage_})


async def _stream_chunks(rid: str, created: int, model: str,
                         outputs: AsyncIterator[tuple[int, ReqOutput]], num: int, n: int,
                         chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
    sent = [0] * num  # characters of each choice's text already streamed
    last: list[ReqOutput | None] = [None] * num
    if chat:
        for i in range(num):
            yield _chunk(rid, created, model, i, "", None, chat, role=True)
    async for i, out in outputs:
        last[i] = out
        piece = out.text[sent[i]:]
        sent[i] = len(out.text)
        if piece or out.finished:
            yield _chunk(rid, created, model, i, piece, finish_reason(out), chat)
    if include_usage:
        yield _chunk(rid, created, model, 0, "" if chat else None, None, chat,
                     usage_=usage(last, n))
