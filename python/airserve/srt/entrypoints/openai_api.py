"""OpenAI-compatible `/v1/completions` and `/v1/chat/completions`: protocol and adapters.

Requests are validated with pydantic (strict types, finite numbers) and the shared request
check (`managers/validation.py`); fields airserve does not implement are refused when set
(`OPENAI_NOT_IMPLEMENTED`), other unknown fields (client bookkeeping such as `user`) are ignored,
as SGLang does. Parsing, validation and tokenization run off the event loop. A request becomes
one airserve request per (prompt, choice), and the outputs are shaped into
OpenAI's responses or SSE chunks. Every streamed chunk carries a non-empty `choices[0]`
(SGLang's and vLLM's benchmark clients index it unconditionally), the usage chunk included.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from airserve.srt.entrypoints.http_utils import (
    final_outputs,
    off_loop,
    parse_json_object,
    sse,
    stream_response,
)
from airserve.srt.managers.tokenizer_manager import ReqOutput, RequestError, TokenizerManager
from airserve.srt.managers.validation import (
    OPENAI_NOT_IMPLEMENTED,
    FieldError,
    RequestLimits,
    check_fits,
    check_input_ids,
    check_text,
    refuse_not_implemented,
    validate_request,
)
from airserve.srt.sampling.sampling_params import (
    INT32_MAX,
    INT64_MAX,
    SamplingParams,
    expect_int,
)
from airserve.srt.tokenizer import Tokenizer

MAX_CHOICES = 64  # n above this is refused, not queued

# What a wrongly typed field should have been, for error messages.
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of such lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


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
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    skip_special_tokens: bool = True
    data_parallel_rank: int | None = Field(None, ge=0)  # SGLang's: send it to that replica


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)


def parse_request(model: type[_Strict], body: dict) -> _Strict:
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


# Requests -> airserve requests (CPU-bound: these run off the event loop).
@dataclass
class Prepared:
    """A validated, tokenized request: one airserve request per (prompt, choice)."""

    req: _SamplingFields
    prompts: list[list[int]]
    params: list[list[dict]]  # [prompt][choice], SamplingParams as dicts


def prepare_completion(raw: bytes, tokenizer: Tokenizer, limits: RequestLimits) -> Prepared:
    req = parse_request(CompletionRequest, parse_json_object(raw))
    prompts = completion_prompts(req, tokenizer, limits)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
    return _prepared(req, prompts, max_tokens, limits)


def prepare_chat(raw: bytes, tokenizer: Tokenizer, limits: RequestLimits) -> Prepared:
    req = parse_request(ChatCompletionRequest, parse_json_object(raw))
    prompt = chat_prompt(req, tokenizer, limits)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    if max_tokens is None:  # OpenAI's default for chat: up to the context length
        max_tokens = max(limits.context_length - len(prompt), 0)
    return _prepared(req, [prompt], max_tokens, limits)


def _prepared(req: _SamplingFields, prompts: list[list[int]], max_tokens: int,
              limits: RequestLimits) -> Prepared:
    params = []
    for ids in prompts:
        check_fits(len(ids), max_tokens, limits)
        choices = [validate_request(ids, sampling_params(req, max_tokens, c), limits)
                   for c in range(req.n)]
        params.append([dataclasses.asdict(p) for p in choices])
    return Prepared(req, prompts, params)


def sampling_params(req: _SamplingFields, max_new_tokens: int, choice: int) -> SamplingParams:
    """SGLang-named sampling parameters, validated (FieldError names the field)."""
    if req.seed is not None:
        expect_int("seed", req.seed, 0, INT64_MAX)
    params = {
        "max_new_tokens": max_new_tokens, "min_new_tokens": req.min_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "min_p": req.min_p, "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty, "repetition_penalty": req.repetition_penalty,
        "stop": req.stop, "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        # n choices with one seed would all be equal; offset it per choice.
        "seed": None if req.seed is None else (req.seed + choice) % (INT64_MAX + 1),
    }
    return SamplingParams.from_dict(params)


def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer,
                       limits: RequestLimits) -> list[list[int]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        return [tokenizer.encode(check_text(prompt, "prompt", limits))]
    if not prompt:
        raise FieldError("prompt", "must not be an empty list")
    if isinstance(prompt[0], int):
        return [check_input_ids(prompt, limits, "prompt")]
    if isinstance(prompt[0], str):
        return [tokenizer.encode(check_text(p, f"prompt.{i}", limits))
                for i, p in enumerate(prompt)]
    return [check_input_ids(p, limits, f"prompt.{i}") for i, p in enumerate(prompt)]


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer,
                limits: RequestLimits) -> list[int]:
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            bad = [p.type for p in content if p.type != "text"]
            if bad:
                raise FieldError(f"messages.{i}.content", f"only text parts are supported, "
                                                          f"got {', '.join(bad)}")
            content = "".join(p.text or "" for p in content)
        messages.append({"role": m.role, "content": content or ""})
    # The template only adds text: contents that cannot fit are refused before rendering.
    check_text("".join(m["content"] for m in messages), "messages", limits)
    try:
        text = tokenizer.apply_chat_template(messages)
    except ValueError as e:
        raise RequestError(400, str(e)) from None
    return tokenizer.encode(check_text(text, "messages", limits))


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

    def __init__(self, manager: TokenizerManager, model_names: tuple[str, ...],
                 limits: RequestLimits) -> None:
        self.manager = manager
        self.model_names = model_names
        self.limits = limits

    async def completions(self, request: Request):
        prepared = await off_loop(prepare_completion, await request.body(),
                                  self.manager.tokenizer, self.limits)
        return await self._serve(request, prepared, chat=False)

    async def chat(self, request: Request):
        prepared = await off_loop(prepare_chat, await request.body(), self.manager.tokenizer,
                                  self.limits)
        return await self._serve(request, prepared, chat=True)

    async def _serve(self, request: Request, prepared: Prepared, chat: bool):
        req = prepared.req
        model = resolve_model(req, self.model_names)
        streams = [self.manager.generate(ids, p, stream=req.stream,
                                         dp_rank=req.data_parallel_rank)
                   for ids, choices in zip(prepared.prompts, prepared.params) for p in choices]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if not req.stream:
            outputs = await final_outputs(request, streams)
            return JSONResponse(_response(rid, created, model, outputs, req.n, chat))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await stream_response(request, streams, lambda outputs: _stream_chunks(
            rid, created, model, outputs, len(streams), req.n, chat, include_usage))


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
