"""Offline engine: the scheduler and model runner in this process, no server."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Iterator, Sequence

from airserve.srt.managers.req import Req
from airserve.srt.managers.scheduler import Scheduler, SchedulerConfig
from airserve.srt.model_executor.model_runner import ModelRunner
from airserve.srt.sampling.sampling_params import SamplingParams
from airserve.srt.server_args import ServerArgs
from airserve.srt.tokenizer import IncrementalDecoder, Tokenizer, get_tokenizer

logger = logging.getLogger(__name__)


def build_req(tokenizer: Tokenizer, input_ids: list[int], params: SamplingParams,
              rid: str | None = None, stream: bool = False) -> Req:
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=params.skip_special_tokens)
    return Req(rid=rid or uuid.uuid4().hex, input_ids=input_ids, sampling_params=params,
               decoder=decoder, stream=stream)


def req_output(req: Req, text: str | None = None) -> dict:
    meta = {
        "id": req.rid,
        "prompt_tokens": len(req.input_ids),
        "cached_tokens": req.cached_tokens,
        "completion_tokens": len(req.output_ids),
        "finish_reason": req.finished_reason,
        "e2e_latency": (req.finished_time or 0) - req.created_time if req.finished else None,
    }
    return {"text": req.output_text() if text is None else text,
            "output_ids": list(req.output_ids), "meta_info": meta}


def eos_token_ids(model_runner: ModelRunner, tokenizer: Tokenizer) -> tuple[int, ...]:
    ids = set(model_runner.model_config.eos_token_ids) | set(tokenizer.eos_token_ids)
    return tuple(sorted(ids))


def scheduler_config(args: ServerArgs) -> SchedulerConfig:
    return SchedulerConfig(max_prefill_tokens=args.max_prefill_tokens,
                           chunked_prefill_size=args.resolved_chunked_prefill_size,
                           enable_mixed_chunk=args.enable_mixed_chunk,
                           schedule_policy=args.schedule_policy,
                           radix_cache=not args.disable_radix_cache)


class Engine:
    """`Engine(model_path=None, device="cpu", **server_args)`; see ServerArgs for the names."""

    def __init__(self, model_path: str | None = None, device: str = "cpu", **kwargs) -> None:
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, device=device, **kwargs)
        args = self.server_args
        self.tokenizer = get_tokenizer(args.tokenizer_path or args.model_path)
        self.model_runner = ModelRunner(args)
        self.scheduler = Scheduler(self.model_runner,
                                   eos_token_ids(self.model_runner, self.tokenizer),
                                   scheduler_config(args))
        self._closed = False

    def generate(self, prompt: str | Sequence[str] | None = None,
                 sampling_params: dict | Sequence[dict] | None = None,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 stream: bool = False) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (returns a dict) or a list (returns a list of dicts).

        With `stream=True`, returns an iterator of dicts whose `text` is cumulative; for a list
        of prompts each dict carries its `index`.
        """
        if self._closed:
            raise RuntimeError("the engine is shut down")
        reqs, single = self._make_reqs(prompt, sampling_params, input_ids, stream)
        for req in reqs:
            self.scheduler.add_request(req)
        if stream:
            return self._stream(reqs, single)
        self._run_until_done(reqs)
        outs = [req_output(r) for r in reqs]
        return outs[0] if single else outs

    def _make_reqs(self, prompt, sampling_params, input_ids, stream) -> tuple[list[Req], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else prompt
            if not isinstance(prompts, (list, tuple)) or not all(
                    isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a string or a list of strings")
            token_lists = [self.tokenizer.encode(p) for p in prompts]
        else:
            if not isinstance(input_ids, (list, tuple)) or not all(
                    isinstance(x, (int, list, tuple)) for x in input_ids):
                raise ValueError("input_ids must be a list of ids or a list of such lists")
            single = len(input_ids) > 0 and isinstance(input_ids[0], int)
            token_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
            vocab = self.model_runner.model_config.vocab_size
            for ids in token_lists:
                if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                    raise ValueError(f"input_ids must be integers in [0, {vocab})")
        if not token_lists:
            raise ValueError("prompt/input_ids is an empty list")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(token_lists):
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for "
                                 f"{len(token_lists)} prompts")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params) for _ in token_lists]
        reqs = [build_req(self.tokenizer, ids, p, stream=stream)
                for ids, p in zip(token_lists, params)]
        for req in reqs:
            self.scheduler.check_request(req.input_ids, req.sampling_params.max_new_tokens)
        return reqs, single

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
        runner = self.model_runner
        info = {
            "server_args": {k: v for k, v in vars(self.server_args).items() if k != "extra"},
            "device": runner.device,
            "context_length": runner.context_len,
            "max_total_tokens": runner.allocator.total_usable_pages * runner.allocator.page_size,
            "available_kv_tokens": runner.allocator.available_tokens(),
            "eager_fallbacks": dict(runner.fallback_counts),
            "scheduler": dict(self.scheduler.stats),
            "prefix_cache": self.scheduler.cache_report(),
            "schedule": dataclasses.asdict(self.scheduler.config),
            "decode_kernels": runner.kernels_report(),
        }
        if runner.graph_runner is not None:
            info["graph_runner"] = runner.graph_runner.report()
        return info

    def shutdown(self) -> None:
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
