"""OpenAI-compatible `/v1/completions` and `/v1/chat/completions`: the routes and adapters.

Requests are parsed by `openai_protocol.py` and checked by the shared request check
(`managers/validation.py`); parsing, validation and tokenization run off the event loop. A
request becomes one airserve request per (prompt, choice), and the outputs are shaped into
OpenAI's responses or SSE chunks: tool calls read by `tool_calls.py`, logprobs shaped by
`logprob_format.py` (chat `logprobs` / `top_logprobs`, completions `logprobs: k` and `echo`, of
the model's raw distribution); the n choices of a prompt start once the first has prefilled it
(prefix cache). Every streamed chunk carries a non-empty `choices[0]` (SGLang's and vLLM's
benchmark clients index it unconditionally), the usage chunk included.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from airserve.srt.entrypoints.http_utils import (
    final_outputs,
    off_loop,
    parse_json_object,
    share_prompt,
    sse,
    stream_response,
)
from airserve.srt.entrypoints.logprob_format import ChoiceShape, TokenText
from airserve.srt.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    parse_request,
)
from airserve.srt.entrypoints.structured_output import grammar_fields
from airserve.srt.entrypoints.tool_calls import (
    ToolPlan,
    chat_message,
    output_reader,
    plan_tools,
    tool_finish_reason,
)
from airserve.srt.entrypoints.tool_calls import template_message as tool_template_message
from airserve.srt.entrypoints.tool_parser import template_format
from airserve.srt.managers.tokenizer_manager import ReqOutput, RequestError, TokenizerManager
from airserve.srt.managers.validation import (
    FieldError,
    RequestLimits,
    check_fits,
    check_input_ids,
    check_logprob,
    check_text,
    validate_request,
)
from airserve.srt.sampling.logprobs import LogprobParams
from airserve.srt.sampling.sampling_params import (
    INT64_MAX,
    SamplingParams,
    expect_int,
    sample_seed,
)
from airserve.srt.tokenizer import Tokenizer


# Requests -> airserve requests (CPU-bound: these run off the event loop).
@dataclass
class Prepared:
    """A validated, tokenized request: one airserve request per (prompt, choice)."""

    req: SamplingFields
    prompts: list[list[int]]
    params: list[list[dict]]  # [prompt][choice], SamplingParams as dicts
    logprob: LogprobParams | None = None  # the same for every prompt
    echo_texts: list[str] | None = None  # completions with echo: each prompt's text
    tools: ToolPlan | None = None  # chat with tools in play
    tool_format: str = "json"  # how the template writes calls (tool_parser.template_format)


def prepare_completion(raw: bytes, tokenizer: Tokenizer, limits: RequestLimits) -> Prepared:
    req = parse_request(CompletionRequest, parse_json_object(raw))
    prompts = completion_prompts(req, tokenizer, limits)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
    if req.echo and req.stream:
        raise FieldError("echo", "not supported with stream: true; ask without streaming")
    prepared = _prepared(req, prompts, max_tokens, limits)
    if req.logprobs is not None:
        # echo: the prompt's logprobs too, from its first token (whose logprob is null).
        prepared.logprob = LogprobParams(True, req.logprobs, 0 if req.echo else -1)
    if req.echo:
        prepared.echo_texts = echo_texts(req, prompts, tokenizer)
    for ids in prompts:
        check_logprob(prepared.logprob, len(ids), max_tokens, "max_tokens")
    return prepared


def echo_texts(req: CompletionRequest, prompts: list[list[int]],
               tokenizer: Tokenizer) -> list[str]:
    """The text each prompt echoes: as sent, or decoded when sent as token ids."""
    if isinstance(req.prompt, str):
        return [req.prompt]
    if isinstance(req.prompt[0], str):
        return list(req.prompt)
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


def prepare_chat(raw: bytes, tokenizer: Tokenizer, limits: RequestLimits) -> Prepared:
    req = parse_request(ChatCompletionRequest, parse_json_object(raw))
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, tokenizer)
    prompt = chat_prompt(req, tokenizer, limits, plan.tools if plan else None)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    if max_tokens is None:  # OpenAI's default for chat: up to the context length
        max_tokens = max(limits.context_length - len(prompt), 0)
    if req.top_logprobs is not None and not req.logprobs:
        raise FieldError("top_logprobs", "needs logprobs: true")
    prepared = _prepared(req, [prompt], max_tokens, limits, plan)
    prepared.tools, prepared.tool_format = plan, template_format(tokenizer.chat_template)
    if req.logprobs:
        prepared.logprob = LogprobParams(True, req.top_logprobs or 0, -1)
    return prepared


def _prepared(req: SamplingFields, prompts: list[list[int]], max_tokens: int,
              limits: RequestLimits, plan: ToolPlan | None = None) -> Prepared:
    grammar = grammar_fields(req, plan)
    params = []
    for ids in prompts:
        check_fits(len(ids), max_tokens, limits)
        choices = [validate_request(ids, sampling_params(req, max_tokens, c, grammar), limits)
                   for c in range(req.n)]
        params.append([dataclasses.asdict(p) for p in choices])
    return Prepared(req, prompts, params)


def sampling_params(req: SamplingFields, max_new_tokens: int, choice: int,
                    grammar: dict | None = None) -> SamplingParams:
    """SGLang-named sampling parameters, validated (FieldError names the field); `grammar`:
    the request's json_schema / regex / ebnf field (grammar_fields)."""
    if req.seed is not None:
        expect_int("seed", req.seed, 0, INT64_MAX)
    params = {
        "max_new_tokens": max_new_tokens, "min_new_tokens": req.min_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "min_p": req.min_p, "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty, "repetition_penalty": req.repetition_penalty,
        "stop": req.stop, "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens, "logit_bias": req.logit_bias,
        "seed": sample_seed(req.seed, choice),
        **(grammar or {}),
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


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer, limits: RequestLimits,
                tools: list[dict] | None = None) -> list[int]:
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            bad = [p.type for p in content if p.type != "text"]
            if bad:
                raise FieldError(f"messages.{i}.content", f"only text parts are supported, "
                                                          f"got {', '.join(bad)}")
            content = "".join(p.text or "" for p in content)
        message = {"role": m.role, "content": content or ""}
        message.update(m.model_dump(include={"name", "tool_calls", "tool_call_id"},
                                    exclude_none=True))
        messages.append(tool_template_message(message))
    # The template only adds text: contents that cannot fit are refused before rendering.
    check_text("".join(m["content"] for m in messages), "messages", limits)
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools)
    except ValueError as e:
        raise RequestError(400, str(e)) from None
    return tokenizer.encode(check_text(text, "messages", limits))


def resolve_model(req: SamplingFields, names: tuple[str, ...]) -> str:
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
        streams = [s for ids, choices in zip(prepared.prompts, prepared.params)
                   for s in share_prompt([self.manager.generate(
                       ids, p, stream=req.stream, logprob=prepared.logprob,
                       dp_rank=req.data_parallel_rank) for p in choices])]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        shape = ChoiceShape(chat, TokenText(self.manager.tokenizer), prepared.logprob,
                            prepared.prompts, req.n, prepared.echo_texts)
        if not req.stream:
            outputs = await final_outputs(request, streams)
            return JSONResponse(_response(rid, created, model, outputs, prepared, shape))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await stream_response(request, streams, lambda outputs: _stream_chunks(
            rid, created, model, outputs, len(streams), prepared, shape, include_usage))


def _response(rid: str, created: int, model: str, outputs: list[ReqOutput],
              prepared: Prepared, shape: ChoiceShape) -> dict:
    chat = shape.chat
    choices = []
    for i, out in enumerate(outputs):
        reader = output_reader(prepared.tools, prepared.tool_format)
        content, calls = reader.feed(out.text, True)
        choice = {"index": i, "logprobs": shape.logprobs(i, out),
                  "finish_reason": tool_finish_reason(finish_reason(out), reader)}
        if chat:
            choice["message"] = chat_message(content, calls)
        else:
            choice["text"] = shape.content(i, out)
        choices.append(choice)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": choices,
            "usage": usage(outputs, prepared.req.n)}


def _chunk(rid: str, created: int, model: str, index: int, text: str | None,
           reason: str | None, chat: bool, usage_: dict | None = None,
           role: bool = False, logprobs: dict | None = None,
           tool_calls: list[dict] | None = None) -> bytes:
    choice: dict = {"index": index, "logprobs": logprobs, "finish_reason": reason}
    if chat:
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": model, "choices": [choice], "usage": usage_})


async def _stream_chunks(rid: str, created: int, model: str,
                         outputs: AsyncIterator[tuple[int, ReqOutput]], num: int,
                         prepared: Prepared, shape: ChoiceShape,
                         include_usage: bool) -> AsyncIterator[bytes]:
    chat = shape.chat
    # What of each choice is streamed.
    readers = [output_reader(prepared.tools, prepared.tool_format) for _ in range(num)]
    last: list[ReqOutput | None] = [None] * num
    if chat:
        for i in range(num):
            yield _chunk(rid, created, model, i, "", None, chat, role=True)
    async for i, out in outputs:
        last[i] = out
        piece, calls = readers[i].feed(out.text, out.finished)
        reason = tool_finish_reason(finish_reason(out), readers[i])
        logprobs, new_tokens = shape.new_logprobs(i, out)
        if calls:  # each call whole, numbered across the choice's calls
            if piece or logprobs:
                yield _chunk(rid, created, model, i, piece, None, chat, logprobs=logprobs)
            first = len(readers[i].calls) - len(calls)
            yield _chunk(rid, created, model, i, None, reason, chat, tool_calls=[
                c.to_dict(first + k) for k, c in enumerate(calls)])
        elif piece or out.finished or (logprobs and new_tokens):
            yield _chunk(rid, created, model, i, piece, reason, chat, logprobs=logprobs)
    if include_usage:
        yield _chunk(rid, created, model, 0, "" if chat else None, None, chat,
                     usage_=usage(last, prepared.req.n))
