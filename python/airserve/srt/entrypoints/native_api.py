"""SGLang's native `/generate`: request parsing and response shapes.

Accepts what SGLang's clients send (docs/design.md, "What SGLang's own clients send"): `text` or
`input_ids`, one or a list, `sampling_params` (one dict or one per prompt), `stream`, `rid`;
unknown or null top-level fields are ignored. Streaming sends `data: <json>` events whose
`text` and `meta_info.completion_tokens` are cumulative, then `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

from fastapi import Request
from fastapi.responses import JSONResponse

from airserve.srt.entrypoints.http_utils import (
    final_outputs,
    read_json_object,
    sse,
    stream_response,
)
from airserve.srt.managers.tokenizer_manager import ReqOutput, RequestError, TokenizerManager
from airserve.srt.sampling.sampling_params import SamplingParams

# Top-level fields that change the answer and that airserve cannot honour when set.
UNSUPPORTED_WHEN_SET = ("return_logprob", "return_hidden_states", "input_embeds", "image_data",
                        "lora_path", "session_params")


@dataclass
class GenerateRequest:
    prompts: list[list[int]]
    params: list[dict]
    stream: bool
    rids: list[str | None]
    single: bool


def parse_generate(body: dict, manager: TokenizerManager) -> GenerateRequest:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError(400, "give exactly one of text or input_ids")
    bad = [name for name in UNSUPPORTED_WHEN_SET if body.get(name) not in (None, False, [], "")]
    # SGLang clients send lora_path: null and return_logprob: false; only set values are refused.
    if bad:
        raise RequestError(400, f"{', '.join(bad)}: not supported by airserve; leave it unset")
    if text is not None:
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError(400, "text: must be a string or a non-empty list of strings")
        prompts = [manager.tokenizer.encode(t) for t in texts]
    else:
        single = isinstance(ids, list) and bool(ids) and not isinstance(ids[0], list)
        prompts = [ids] if single else ids
        if not isinstance(prompts, list) or not prompts or not all(
                isinstance(p, list) and all(type(t) is int for t in p) for p in prompts):
            raise RequestError(400, "input_ids: must be a non-empty list of token ids or a "
                                    "list of such lists")
    params = _sampling_params(body.get("sampling_params"), len(prompts))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, f"stream: must be true or false, got {stream!r}")
    rids = _rids(body.get("rid"), len(prompts))
    for p, sp in zip(prompts, params):
        manager.check_request(p, sp.get("max_new_tokens", SamplingParams.max_new_tokens))
    return GenerateRequest(prompts, params, stream, rids, single)


def _rids(raw, n: int) -> list[str | None]:
    if raw is None:
        return [None] * n
    if isinstance(raw, str) and n == 1:
        return [raw]
    if isinstance(raw, list) and len(raw) == n and all(isinstance(r, str) for r in raw):
        return raw
    raise RequestError(400, "rid: must be a string (one prompt) or a list of one per prompt")


def _sampling_params(raw, n: int) -> list[dict]:
    if raw is None:
        raw = {}
    if isinstance(raw, dict):
        raw = [raw] * n
    if not isinstance(raw, list) or not all(isinstance(p, dict) for p in raw):
        raise RequestError(400, "sampling_params: must be an object or a list of objects")
    if len(raw) != n:
        raise RequestError(400, f"sampling_params has {len(raw)} entries for {n} prompts")
    for p in raw:
        try:
            SamplingParams.from_dict(p)
        except (ValueError, TypeError) as e:
            raise RequestError(400, f"sampling_params: {e}") from None
    return [{k: v for k, v in p.items() if v is not None} for p in raw]


def output_dict(out: ReqOutput, index: int | None = None) -> dict:
    meta = {
        "id": out.rid,
        "finish_reason": out.finished_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": 0,
        "e2e_latency": out.e2e_latency,
    }
    d = {"text": out.text, "output_ids": out.output_ids, "meta_info": meta}
    if index is not None:
        d["index"] = index
    return d


async def generate(request: Request, manager: TokenizerManager):
    req = parse_generate(await read_json_object(request), manager)
    streams = [manager.generate(ids, p, stream=req.stream, rid=rid)
               for ids, p, rid in zip(req.prompts, req.params, req.rids)]
    if req.stream:
        return await stream_response(request, streams, partial(_events, single=req.single))
    result = [output_dict(o) for o in await final_outputs(request, streams)]
    return JSONResponse(result[0] if req.single else result)


async def _events(outputs: AsyncIterator[tuple[int, ReqOutput]],
                  single: bool) -> AsyncIterator[bytes]:
    async for i, out in outputs:
        yield sse(output_dict(out, None if single else i))
