"""What serves requests in one process: tokenizer, model runner and scheduler, built once.

The scheduler process and the offline `Engine` both stand on this; neither builds the parts
itself.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

from airserve.srt.constrained.backend import GrammarBackend
from airserve.srt.managers.req import Req
from airserve.srt.managers.scheduler import Scheduler, SchedulerConfig
from airserve.srt.managers.validation import RequestLimits
from airserve.srt.model_executor.model_runner import ModelRunner
from airserve.srt.sampling.logprobs import LogprobParams
from airserve.srt.sampling.sampling_params import SamplingParams
from airserve.srt.server_args import ServerArgs
from airserve.srt.tokenizer import IncrementalDecoder, Tokenizer, get_tokenizer

logger = logging.getLogger(__name__)


def build_req(tokenizer: Tokenizer, input_ids: list[int], params: SamplingParams,
              rid: str | None = None, stream: bool = False,
              logprob: LogprobParams | None = None) -> Req:
    """A Req with its incremental decoder (and seeded generator, from the params)."""
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=params.skip_special_tokens)
    return Req(rid=rid or uuid.uuid4().hex, input_ids=input_ids, sampling_params=params,
               decoder=decoder, stream=stream, logprob=logprob)


def eos_token_ids(model_runner: ModelRunner, tokenizer: Tokenizer) -> tuple[int, ...]:
    ids = set(model_runner.model_config.eos_token_ids) | set(tokenizer.eos_token_ids)
    return tuple(sorted(ids))


def scheduler_config(args: ServerArgs) -> SchedulerConfig:
    return SchedulerConfig(max_prefill_tokens=args.max_prefill_tokens,
                           chunked_prefill_size=args.resolved_chunked_prefill_size,
                           decode_chunked_prefill_size=args.resolved_decode_chunked_prefill_size,
                           enable_mixed_chunk=args.enable_mixed_chunk,
                           schedule_policy=args.schedule_policy,
                           radix_cache=not args.disable_radix_cache)


class EngineCore:
    """`tokenizer`, `model_runner` and `scheduler` for one ServerArgs."""

    def __init__(self, server_args: ServerArgs) -> None:
        self.server_args = args = server_args
        start = time.perf_counter()
        logger.info("loading the tokenizer")
        self.tokenizer = get_tokenizer(args.tokenizer_path or args.model_path)
        self.model_runner = ModelRunner(args)
        eos = eos_token_ids(self.model_runner, self.tokenizer)
        # Compiles structured-output grammars in a worker thread; xgrammar loads on first use.
        self.grammar_backend = GrammarBackend(self.tokenizer,
                                              self.model_runner.model_config.vocab_size, eos)
        self.scheduler = Scheduler(self.model_runner, eos, scheduler_config(args),
                                   self.grammar_backend)
        logger.info("model loaded in %.1fs", time.perf_counter() - start)

    def request_limits(self) -> RequestLimits:
        """What every request is checked against: vocabulary, context, the pool's real size."""
        return RequestLimits.for_model(self.tokenizer, self.model_runner.model_config.vocab_size,
                                       self.model_runner.context_len,
                                       self.kv_pool_info()["tokens"])

    def kv_pool_info(self) -> dict:
        """The KV pool's real size, as allocated (tokens, pages, bytes)."""
        runner = self.model_runner
        alloc = runner.allocator
        return {"tokens": alloc.total_usable_pages * alloc.page_size,
                "pages": alloc.total_usable_pages, "page_size": alloc.page_size,
                "bytes": runner.kv_pool.memory_bytes(),
                "gib": round(runner.kv_pool.memory_bytes() / 2**30, 3),
                "sized_by": runner.kv_pool_sized_by}

    def get_server_info(self) -> dict:
        runner = self.model_runner
        info = {
            "server_args": {k: v for k, v in vars(self.server_args).items() if k != "extra"},
            "device": runner.device,
            "context_length": runner.context_len,
            "max_total_tokens": runner.allocator.total_usable_pages * runner.allocator.page_size,
            # Pages the prefix cache could evict count as available (as in SGLang).
            "available_kv_tokens": self.scheduler.kv.available_pages()
            * runner.allocator.page_size,
            "kv_pool": self.kv_pool_info(),
            "eager_fallbacks": dict(runner.fallback_counts),
            "scheduler": dict(self.scheduler.stats),
            "prefix_cache": self.scheduler.cache_report(),
            "schedule": dataclasses.asdict(self.scheduler.config),
            "decode_kernels": runner.kernels_report(),
            "grammar_backend": self.grammar_backend.report(),
        }
        if runner.graph_runner is not None:
            info["graph_runner"] = runner.graph_runner.report()
        return info
