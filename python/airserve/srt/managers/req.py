"""The one request type the scheduler tracks."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from airserve.srt.sampling.logprobs import LogprobParams, TokenLogprob
from airserve.srt.sampling.sampling_params import SamplingParams
from airserve.srt.tokenizer import IncrementalDecoder

if TYPE_CHECKING:
    from airserve.srt.constrained.backend import GrammarState


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    decoder: IncrementalDecoder
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None  # row in ReqToTokenPool while it holds KV
    kv_len: int = 0  # tokens whose K/V are in the cache
    # KV slots allocated for the row, >= kv_len while a step is being built; all freed on release.
    kv_alloc_len: int = 0
    # The first prefix_len of them are pages shared from the prefix cache, held by locking
    # `last_node` (a radix-cache node); the rest are this request's own pages.
    prefix_len: int = 0
    last_node: object | None = None
    extend_len: int = 0  # tokens this step's forward adds (a prefill chunk, or 1 for decode)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not computed here
    already_computed: int = 0  # most tokens this request ever had in the cache itself
    finished_reason: dict | None = None
    generator: torch.Generator | None = None
    created_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finished_time: float | None = None
    num_retractions: int = 0
    # Structured output: the future of its compiled grammar while it compiles, then its matcher
    # (constrained.backend.GrammarState), which has accepted exactly `output_ids`.
    grammar_future: Future | None = None
    grammar: GrammarState | None = None
    # Output text sent so far, for streaming deltas.
    sent_text_len: int = 0
    sent_token_len: int = 0
    # Logprobs (None: not asked). `input_logprobs[i]` is the logprob of prompt token
    # `logprob_start + 1 + i`, from the logits at the position before it; `output_logprobs[i]`
    # that of output token i. Both only grow; `sent_*` count what went to the client.
    logprob: LogprobParams | None = None
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    sent_input_logprobs: bool = False
    sent_output_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def logprob_start(self) -> int:
        """First prompt position listed in input_token_logprobs (meaningful with `logprob`)."""
        return self.logprob.start(len(self.input_ids)) if self.logprob else len(self.input_ids)

    @property
    def prompt_logits_from(self) -> int | None:
        """The first prompt position whose logits are still needed for input logprobs (they
        predict the next prompt token), or None when none are: a prefill must compute from
        there, so the prefix cache may supply at most this many tokens."""
        if self.logprob is None or not self.logprob.return_logprob:
            return None
        pos = self.logprob_start + len(self.input_logprobs)
        return pos if pos < len(self.input_ids) - 1 else None

    @property
    def fill_ids(self) -> list[int]:
        """Tokens a (re-)prefill must process: after retraction, the outputs are re-read too."""
        return self.input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def text(self) -> str:
        return self.decoder.text

    def output_text(self) -> str:
        """The text to return: cut at a matched stop string, which is not included."""
        text = self.decoder.text
        reason = self.finished_reason or {}
        matched = reason.get("matched")
        if reason.get("type") == "stop" and isinstance(matched, str):
            cut = text.find(matched)
            if cut >= 0:
                return text[:cut]
        return text

    def stream_text(self) -> str:
        """Text that is safe to stream now: holds back a tail that may grow into a stop string."""
        if self.finished:
            return self.output_text()
        text = self.decoder.text
        hold = 0
        for stop in self.sampling_params.stop:
            for n in range(min(len(stop) - 1, len(text)), hold, -1):
                if stop.startswith(text[-n:]):
                    hold = n
                    break
        return text[: len(text) - hold]
