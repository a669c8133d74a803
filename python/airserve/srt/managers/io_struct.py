"""Every message on the pipe between the HTTP process and the scheduler process.

Plain dataclasses (pickled by `multiprocessing`), one per kind, so a reader follows a request by
its type and field names. The HTTP side is `tokenizer_manager.py`, the scheduler side
`scheduler_process.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from airserve.srt.sampling.logprobs import LogprobParams, TokenLogprob

# HTTP process -> scheduler process.


@dataclass
class GenerateReqInput:
    """A tokenized request; `sampling_params` is the client's dict, validated in the scheduler
    process too (it builds the SamplingParams)."""

    rid: str
    input_ids: list[int]
    sampling_params: dict
    stream: bool = False
    logprob: LogprobParams | None = None  # None: no logprobs


@dataclass
class AbortReq:
    rid: str


@dataclass
class ServerInfoReq:
    """Asks for the scheduler's part of /get_server_info; answered by a CallReply."""

    token: int


@dataclass
class FlushCacheReq:
    """Asks to flush the KV cache; answered by a CallReply (ok False while requests run)."""

    token: int


@dataclass
class ShutdownReq:
    """Finish the loop: abort what runs, then exit."""


# Scheduler process -> HTTP process.


@dataclass
class SchedulerReady:
    """Sent once, after the model is loaded. `info`: model_path, context_length, vocab_size,
    max_total_tokens (the KV pool's real size), max_running_requests, runner, pid, kv_pool."""

    info: dict


@dataclass
class SchedulerInitError:
    """Instead of SchedulerReady when loading failed; the process exits after sending it."""

    message: str


@dataclass
class ReqDelta:
    """What one request produced in one step. The client's text becomes
    `text[:text_offset] + text`, so it stays cumulative without resending it."""

    rid: str
    new_output_ids: list[int]
    text_offset: int
    text: str
    finished_reason: dict | None = None  # {"type": "stop" | "length" | "abort", ...}
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    # Logprob requests only: the prompt's (once, with the first token: logprobs of prompt
    # tokens logprob_start + 1, ...) and those of `new_output_ids`.
    input_logprobs: list[TokenLogprob] | None = None
    output_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class ReqError:
    """The request failed and is gone from the scheduler (its KV freed). `status`: 400 when the
    request is at fault (rejected on arrival or while processing), 500 for a server fault."""

    rid: str
    status: int
    message: str


@dataclass
class BatchOutput:
    """One per scheduler step that changed something; `stats` rides along at most every
    STATS_INTERVAL_S (None otherwise)."""

    deltas: list[ReqDelta] = field(default_factory=list)
    errors: list[ReqError] = field(default_factory=list)
    stats: dict | None = None


@dataclass
class CallReply:
    """The answer to a ServerInfoReq or FlushCacheReq with the same token."""

    token: int
    ok: bool
    payload: object


@dataclass
class SchedulerFatal:
    """The loop crashed; the process exits after sending it."""

    message: str
