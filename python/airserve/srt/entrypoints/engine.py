"""Offline engine: the scheduler and model runner in this process, no server.

`Engine.generate` takes what SGLang's offline engine takes: `prompt` or `input_ids`, one or a
list, `sampling_params` (one dict or one per prompt; `n` > 1 gives n samples per prompt, listed
prompt by prompt as /generate does), `stream`, and the logprob arguments `return_logprob`,
`logprob_start_len`, `top_logprobs_num` (one value or one per prompt), answered in `meta_info`
in /generate's layout. Arguments are checked by the HTTP front doors' rules
(`managers/validation.py`); a ValueError names the bad one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence

from airserve.srt.entrypoints.logprob_format import sglang_logprobs
from airserve.srt.managers.engine_core import EngineCore, build_req
from airserve.srt.managers.req import Req
from airserve.srt.managers.validation import (
    FieldError,
    check_input_ids,
    check_text,
    parse_logprob,
    prompt_sampling_params,
    validate_request,
)
from airserve.srt.sampling.sampling_params import sample_seed
from airserve.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def req_output(req: Req, text: str | None = None) -> dict:
    meta = {
        "id": req.rid,
        "prompt_tokens": len(req.input_ids),
        "cached_tokens": req.cached_tokens,
        "completion_tokens": len(req.output_ids),
        "finish_reason": req.finished_reason,
        "e2e_latency": (req.finished_time or 0) - req.created_time if req.finished else None,
    }
    if req.logprob is not None:
        # As /generate sends them: the prompt's logprobs once they are all in (with the first
        # output token), each output token's beside it.
        meta.update(sglang_logprobs(req.input_ids, req.logprob,
                                    req.input_logprobs if req.output_ids else None,
                                    req.output_logprobs[:len(req.output_ids)], None))
    return {"text": req.output_text() if text is None else text,
            "output_ids": list(req.output_ids), "meta_info": meta}


class Engine:
    """`Engine(model_path=None, device="cpu", **server_args)`; see ServerArgs for the names."""

    def __init__(self, model_path: str | None = None, device: str = "cpu", **kwargs) -> None:
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, device=device, **kwargs)
        if self.server_args.dp_size != 1:
            raise ValueError(f"dp_size={self.server_args.dp_size}: the offline Engine runs one "
                             "replica in this process; data parallelism is the HTTP server's "
                             "(python -m airserve.launch_server --dp-size N)")
        self.core = EngineCore(self.server_args)
        self.tokenizer = self.core.tokenizer
        self.model_runner = self.core.model_runner
        self.scheduler = self.core.scheduler
        self.limits = self.core.request_limits()
        self._closed = False

    def generate(self, prompt: str | Sequence[str] | None = None,
                 sampling_params: dict | Sequence[dict] | None = None,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 stream: bool = False, return_logprob: bool | Sequence[bool] = False,
                 logprob_start_len: int | Sequence[int] | None = None,
                 top_logprobs_num: int | Sequence[int] | None = None,
                 ) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (returns a dict) or a list (returns a list of dicts; also
        for one prompt with `n` > 1, its samples in order).

        With `stream=True`, returns an iterator of dicts whose `text` is cumulative; for a list
        each dict carries its `index`. With `return_logprob`, `meta_info` holds
        `input_token_logprobs` (prompt tokens from `logprob_start_len`; -1 or None: the last
        one), `output_token_logprobs` and, with `top_logprobs_num`, `*_top_logprobs`: entries
        (logprob, token_id, None), the model's raw log_softmax, as /generate lists them.
        """
        if self._closed:
            raise RuntimeError("the engine is shut down")
        logprob_args = {"return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
                        "top_logprobs_num": top_logprobs_num}
        reqs, single = self._make_reqs(prompt, sampling_params, input_ids, stream, logprob_args)
        for req in reqs:
            self.scheduler.add_request(req)
        if stream:
            return self._stream(reqs, single)
        self._run_until_done(reqs)
        outs = [req_output(r) for r in reqs]
        return outs[0] if single else outs

    def _make_reqs(self, prompt, sampling_params, input_ids, stream,
                   logprob_args: dict) -> tuple[list[Req], bool]:
        """Checked by the same rules as an HTTP request (`managers/validation.py`); a
        ValueError names the bad argument. n > 1: prompt i's samples are i*n .. i*n+n-1."""
        token_lists, single = self._prompts(prompt, input_ids)
        params, n = prompt_sampling_params(sampling_params, len(token_lists))
        per_prompt = {name: _per_prompt(name, value, len(token_lists))
                      for name, value in logprob_args.items()}
        logprobs = []
        for i, (ids, p) in enumerate(zip(token_lists, params)):
            validate_request(ids, p, self.limits)
            self.scheduler.check_request(ids, p.max_new_tokens)
            args = {name: values[i] for name, values in per_prompt.items()}
            logprobs.append(parse_logprob(args, len(ids), p.max_new_tokens))
        reqs = [build_req(self.tokenizer, ids, dataclasses.replace(p, seed=sample_seed(p.seed, j)),
                          stream=stream, logprob=lp)
                for ids, p, lp in zip(token_lists, params, logprobs) for j in range(n)]
        return reqs, single and n == 1

    def _prompts(self, prompt, input_ids) -> tuple[list[list[int]], bool]:
        """The prompts' token ids, and whether one prompt was given (not in a list)."""
        if (prompt is None) == (input_ids is None):
            raise FieldError("prompt", "give exactly one of prompt or input_ids")
        limits = self.limits
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else prompt
            if not isinstance(prompts, (list, tuple)):
                raise FieldError("prompt", "must be a string or a list of strings")
            token_lists = [self.tokenizer.encode(check_text(p, "prompt", limits))
                           for p in prompts]
        else:
            single = isinstance(input_ids, (list, tuple)) and len(input_ids) > 0 \
                and not isinstance(input_ids[0], (list, tuple))
            batch = [input_ids] if single else input_ids
            if not isinstance(batch, (list, tuple)):
                raise FieldError("input_ids", "must be a list of ids or a list of such lists")
            token_lists = [check_input_ids(ids, limits) for ids in batch]
        if not token_lists:
            raise FieldError("prompt", "is an empty list")
        return token_lists, single

    def _run_until_done(self, reqs: list[Req]) -> None:
        while not all(r.finished for r in reqs):
            self.scheduler.step()

    def _stream(self, reqs: list[Req], single: bool) -> Iterator[dict]:
        index = {id(r): i for i, r in enumerate(reqs)}
        pending = set(index)
        try:
            while pending:
                for req in self.scheduler.step():
                    if id(req) not in pending:
                        continue
                    out = req_output(req, text=req.stream_text())
                    if not single:
                        out["index"] = index[id(req)]
                    if req.finished:
                        pending.discard(id(req))
                    yield out
        finally:
            for req in reqs:
                if not req.finished:
                    self.scheduler.abort(req.rid)

    def get_server_info(self) -> dict:
        return self.core.get_server_info()

    def shutdown(self) -> None:
        if not self._closed:
            self.model_runner.shutdown()  # stops tensor-parallel ranks, if any
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _per_prompt(name: str, value: object, num_prompts: int) -> list:
    """An argument given once for every prompt, or as a list of one per prompt."""
    if not isinstance(value, (list, tuple)):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise FieldError(name, f"has {len(value)} entries for {num_prompts} prompts")
    return list(value)
