"""Which logit rows a step needs for logprobs, and the logprobs taken from them.

Most requests need one logit row per step (their last token's, to sample from). A request that
asks for prompt logprobs also needs the rows of the prompt positions from `logprob_start`: the
logits at position p give the logprob of prompt token p + 1. Those rows come from the same
prefill forward (the model projects only the selected hidden rows; no second forward), chunk by
chunk when the prompt is prefilled in chunks. Output logprobs come from the row sampled from,
in decode from the graph runner's replay as much as from eager.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from airserve.srt.managers.req import Req
from airserve.srt.sampling.logprobs import token_logprobs


def prompt_positions(req: Req, start: int, n: int) -> range:
    """Prompt positions among [start, start + n) (this step's tokens of `req`) whose logits
    its prompt logprobs still need."""
    need = req.prompt_logits_from
    if need is None:
        return range(0)
    return range(max(start, need), min(start + n, len(req.input_ids) - 1))


def logit_rows(reqs: Sequence[Req], starts: Sequence[int],
               lens: Sequence[int]) -> tuple[list[int], list[int]] | None:
    """(rows, counts) for an extend batch whose request i adds `lens[i]` tokens after
    `starts[i]`: each request's prompt-logprob rows, then its last row. None when every
    request needs its last row only."""
    rows: list[int] = []
    counts: list[int] = []
    offset = 0
    wanted = False
    for req, start, n in zip(reqs, starts, lens):
        extra = [offset + p - start for p in prompt_positions(req, start, n)]
        wanted = wanted or bool(extra)
        rows.extend(extra)
        rows.append(offset + n - 1)
        counts.append(len(extra) + 1)
        offset += n
    return (rows, counts) if wanted else None


def split_logits(reqs: Sequence[Req], starts: Sequence[int], lens: Sequence[int],
                 counts: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
    """`logits` hold each request's group of rows (`counts[i]`, as `logit_rows` made them):
    record the prompt logprobs of the groups, return the last row of each [len(reqs), vocab]."""
    last: list[int] = []
    offset = 0
    for req, start, n, count in zip(reqs, starts, lens, counts):
        positions = prompt_positions(req, start, n)
        if len(positions) != count - 1:
            raise RuntimeError(f"request {req.rid}: {count - 1} prompt logit rows for "
                               f"{len(positions)} positions")
        if positions:
            targets = [req.input_ids[p + 1] for p in positions]
            req.input_logprobs.extend(token_logprobs(
                logits[offset:offset + count - 1], targets, req.logprob.top_logprobs_num))
        last.append(offset + count - 1)
        offset += count
    return logits[last]


def record_output_logprobs(reqs: Sequence[Req], logits: torch.Tensor,
                           tokens: Sequence[int | None]) -> None:
    """The logprob of each request's new token under the row it was sampled from (rows of
    `logits` follow `reqs`; a None token failed and gets nothing)."""
    for j, (req, token) in enumerate(zip(reqs, tokens)):
        if token is not None and req.logprob is not None and req.logprob.return_logprob:
            req.output_logprobs.extend(
                token_logprobs(logits[j:j + 1], [token], req.logprob.top_logprobs_num))
