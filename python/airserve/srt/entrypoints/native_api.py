"""SGLang's native `/generate`: request parsing and response shapes.

Accepts what SGLang's clients send: `text` or `input_ids`, one or a list, `sampling_params` (one
dict or one per prompt), `stream`, `rid`; SGLang fields airserve does not implement are refused
when set (`NATIVE_NOT_IMPLEMENTED`). Logprobs (`return_logprob`, `top_logprobs_num`,
`logprob_start_len`, `return_text_in_logprobs`) come in `meta_info` as SGLang lays them out;
`sampling_params.n` > 1 answers n samples per prompt (a list, prompt by prompt). Other unknown
or null top-level fields (client bookkeeping such as `priority` or `log_metrics`) are ignored.
Streaming sends `data: <json>` events whose `text`, `meta_info.completion_tokens` and logprob
lists are cumulative, then `data: [DONE]`. `data_parallel_rank` (SGLang's router sets it with
--dp-aware) sends the request to that data-parallel replica.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

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
from airserve.srt.entrypoints.logprob_format import TokenText, sglang_logprobs
from airserve.srt.managers.tokenizer_manager import ReqOutput, TokenizerManager
from airserve.srt.managers.validation import (
    NATIVE_NOT_IMPLEMENTED,
    FieldError,
    RequestLimits,
    check_input_ids,
    check_text,
    parse_logprob,
    prompt_sampling_params,
    refuse_not_implemented,
    validate_request,
)
from airserve.srt.sampling.logprobs import LogprobParams
from airserve.srt.sampling.sampling_params import (
    INT32_MAX,
    expect_bool,
    expect_int,
    sample_seed,
    show,
)
from airserve.srt.tokenizer import Tokenizer


@dataclass
class GenerateRequest:
    prompts: list[list[int]]
    params: list[dict]  # SamplingParams as dicts, validated, every field present
    stream: bool
    rids: list[str | None]
    single: bool
    logprob: list[LogprobParams | None] = field(default_factory=list)  # per prompt
    text_in_logprobs: bool = False
    n: int = 1  # samples per prompt: prompt i's are requests i*n .. i*n+n-1
    dp_rank: int | None = None


def parse_generate(raw: bytes, tokenizer: Tokenizer, limits: RequestLimits) -> GenerateRequest:
    """Parse, validate and tokenize a /generate body (CPU-bound: runs off the event loop).
    Raises FieldError or RequestError(400) naming what is wrong."""
    body = parse_json_object(raw)
    # SGLang clients send lora_path: null and return_logprob: false; only set values are refused.
    refuse_not_implemented(body, NATIVE_NOT_IMPLEMENTED)
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise FieldError("text", "give exactly one of text or input_ids")
    if text is not None:
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not texts:
            raise FieldError("text", f"must be a string or a non-empty list of strings, got "
                                     f"{show(text)}")
        names = ["text"] if single else [f"text.{i}" for i in range(len(texts))]
        checked = [check_text(t, name, limits) for t, name in zip(texts, names)]
        prompts = [tokenizer.encode(t) for t in checked]
    else:
        single = isinstance(ids, list) and bool(ids) and not isinstance(ids[0], list)
        batch = [ids] if single else ids
        if not isinstance(batch, list) or not batch:
            raise FieldError("input_ids", "must be a non-empty list of token ids or a list of "
                                          f"such lists, got {show(ids)}")
        names = ["input_ids"] if single else [f"input_ids.{i}" for i in range(len(batch))]
        prompts = [check_input_ids(p, limits, name) for p, name in zip(batch, names)]
    params, n = prompt_sampling_params(body.get("sampling_params"), len(prompts))
    stream = body.get("stream")
    stream = False if stream is None else expect_bool("stream", stream)
    rids = _rids(body.get("rid"), len(prompts))
    dp_rank = body.get("data_parallel_rank")
    if dp_rank is not None:
        dp_rank = expect_int("data_parallel_rank", dp_rank, 0, INT32_MAX)
    for p, sp in zip(prompts, params):
        validate_request(p, sp, limits)
    logprob = [parse_logprob(body, len(p), sp.max_new_tokens) for p, sp in zip(prompts, params)]
    with_text = body.get("return_text_in_logprobs")
    with_text = False if with_text is None else expect_bool("return_text_in_logprobs", with_text)
    req = GenerateRequest(prompts, [dataclasses.asdict(sp) for sp in params], stream, rids,
                          single, logprob, with_text, n, dp_rank)
    return _expand(req) if n > 1 else req


def _expand(req: GenerateRequest) -> GenerateRequest:
    """n requests per prompt, their seeds offset per sample (one seed would make them equal)."""
    n = req.n
    params = [{**p, "seed": sample_seed(p["seed"], j)} for p in req.params for j in range(n)]
    rids = [None if r is None else f"{r}-{j}" for r in req.rids for j in range(n)]
    return dataclasses.replace(
        req, prompts=[p for p in req.prompts for _ in range(n)], params=params, rids=rids,
        logprob=[lp for lp in req.logprob for _ in range(n)], single=False)


def _rids(raw, n: int) -> list[str | None]:
    if raw is None:
        return [None] * n
    if isinstance(raw, str) and n == 1 and raw:
        return [raw]
    if isinstance(raw, list) and len(raw) == n and all(isinstance(r, str) and r for r in raw) \
            and len(set(raw)) == n:
        return raw
    raise FieldError("rid", "must be a non-empty string (one prompt) or a list of distinct "
                            f"ones, one per prompt; got {show(raw)}")


def output_dict(out: ReqOutput, index: int | None = None, prompt: list[int] | None = None,
                logprob: LogprobParams | None = None, text: TokenText | None = None) -> dict:
    meta = {
        "id": out.rid,
        "finish_reason": out.finished_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "e2e_latency": out.e2e_latency,
    }
    if logprob is not None:
        meta.update(sglang_logprobs(prompt, logprob, out.input_logprobs, out.output_logprobs,
                                    text))
    d = {"text": out.text, "output_ids": out.output_ids, "meta_info": meta}
    if index is not None:
        d["index"] = index
    return d


async def generate(request: Request, manager: TokenizerManager, limits: RequestLimits):
    req = await off_loop(parse_generate, await request.body(), manager.tokenizer, limits)
    streams = [manager.generate(ids, p, stream=req.stream, rid=rid, logprob=lp,
                                dp_rank=req.dp_rank)
               for ids, p, rid, lp in zip(req.prompts, req.params, req.rids, req.logprob)]
    streams = [s for i in range(0, len(streams), req.n) for s in share_prompt(
        streams[i:i + req.n])]
    text = TokenText(manager.tokenizer) if req.text_in_logprobs else None
    shape = partial(_shape, req=req, text=text)
    if req.stream:
        return await stream_response(request, streams,
                                     partial(_events, shape=shape, single=req.single))
    outputs = await final_outputs(request, streams)
    result = [shape(i, o, single=False) for i, o in enumerate(outputs)]
    return JSONResponse(result[0] if req.single else result)


def _shape(i: int, out: ReqOutput, req: GenerateRequest, text: TokenText | None,
           single: bool) -> dict:
    return output_dict(out, None if single else i, req.prompts[i], req.logprob[i], text)


async def _events(outputs: AsyncIterator[tuple[int, ReqOutput]], shape,
                  single: bool) -> AsyncIterator[bytes]:
    async for i, out in outputs:
        yield sse(shape(i, out, single=single))
