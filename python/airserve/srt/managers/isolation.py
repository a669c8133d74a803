"""Failure isolation for one scheduler step: a request that makes the forward pass or sampling
raise fails alone (Scheduler.fail_request), and the rest of its batch goes on.

A batched call that raises is retried row by row: rows that fail again are the culprits; rows
that succeed keep their results. When every row fails, every row fails with the reason.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from airserve.srt.distributed.errors import TensorParallelError
from airserve.srt.forward_batch import ForwardBatch
from airserve.srt.sampling.sampler import sample
from airserve.srt.sampling.token_mask import apply_grammar_masks

if TYPE_CHECKING:
    from airserve.srt.managers.req import Req
    from airserve.srt.managers.scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger(__name__)

# Raised by a request's own values (a field that slipped past validation, a value that cannot
# be represented): the client's fault, HTTP 400. Anything else is a server fault, HTTP 500.
REQUEST_FAULTS = (TypeError, ValueError, OverflowError)


def status_for(error: Exception) -> int:
    return 400 if isinstance(error, REQUEST_FAULTS) else 500


def forward_isolated(scheduler: Scheduler, batch: ScheduledBatch) -> tuple[list[int],
                                                                          torch.Tensor]:
    """(rows that ran, their logits [len(rows), vocab]). Failed rows are failed requests."""
    fb = batch.fb
    try:
        return list(range(len(batch.reqs))), scheduler.runner.forward(fb)
    except TensorParallelError:
        raise  # not one request's fault: the ranks are out of step and the server stops
    except Exception as e:  # noqa: BLE001 - find the culprit rows below
        if len(batch.reqs) == 1:
            scheduler.fail_request(batch.reqs[0], e, "running the model", fb.seq_lens_cpu[0])
            return [], torch.empty(0)
        logger.warning("a %s batch of %d requests failed (%s: %s); retrying them one by one",
                       fb.forward_mode.name, len(batch.reqs), type(e).__name__, e)
    rows, logits = [], []
    for i, req in enumerate(batch.reqs):
        try:
            logits.append(scheduler.runner.forward(sub_batch(fb, i)))
            rows.append(i)
        except Exception as e:  # noqa: BLE001 - this row is a culprit
            scheduler.fail_request(req, e, "running the model", fb.seq_lens_cpu[i])
    return rows, torch.cat(logits) if logits else torch.empty(0)


def sample_isolated(scheduler: Scheduler, reqs: list[Req], logits: torch.Tensor,
                    kv_lens: list[int]) -> list[int | None]:
    """One token per request, None where its sampling raised (that request is failed;
    `kv_lens[j]`: the KV tokens request j holds after this step's forward)."""
    if not reqs:
        return []
    # A grammar decides itself when EOS may come; banning it could leave no token at all.
    banned = [scheduler.eos_token_ids if len(r.output_ids) < r.sampling_params.min_new_tokens
              and r.grammar is None else () for r in reqs]

    def run(rows: list[int]) -> list[int]:
        grammars = [reqs[j].grammar for j in rows]
        if any(g is not None for g in grammars):
            rows_logits = logits[rows]  # a copy: masking it leaves `logits` for a row-wise retry
            apply_grammar_masks(rows_logits, grammars)
        else:  # `sample` never writes into its logits: no copy (64 rows x vocab is ~12 MiB)
            rows_logits = logits if len(rows) == logits.shape[0] else logits[rows]
        return sample(rows_logits, [reqs[j].sampling_params for j in rows],
                      [reqs[j].input_ids for j in rows], [reqs[j].output_ids for j in rows],
                      [reqs[j].generator for j in rows], [banned[j] for j in rows])

    try:
        return run(list(range(len(reqs))))
    except Exception as e:  # noqa: BLE001 - find the culprit rows below
        if len(reqs) > 1:
            logger.warning("sampling a batch of %d failed (%s: %s); sampling rows one by one",
                           len(reqs), type(e).__name__, e)
    out: list[int | None] = []
    for j, req in enumerate(reqs):
        try:
            out.append(run([j])[0])
        except Exception as e:  # noqa: BLE001 - this request fails alone
            scheduler.fail_request(req, e, "sampling its next token", kv_lens[j])
            out.append(None)
    return out


def sub_batch(fb: ForwardBatch, i: int) -> ForwardBatch:
    """Row `i` of a batch as a batch of one: the same KV slots, positions and lengths."""
    if fb.forward_mode.is_decode():
        start, end = i, i + 1
    else:
        start = sum(fb.extend_seq_lens_cpu[:i])
        end = start + fb.extend_seq_lens_cpu[i]
    one = slice(i, i + 1)
    return ForwardBatch(
        forward_mode=fb.forward_mode, batch_size=1,
        input_ids=fb.input_ids[start:end], positions=fb.positions[start:end],
        req_pool_indices=fb.req_pool_indices[one], seq_lens=fb.seq_lens[one],
        seq_lens_cpu=fb.seq_lens_cpu[one], out_cache_loc=fb.out_cache_loc[start:end],
        kv_cache=fb.kv_cache,
        extend_seq_lens_cpu=fb.extend_seq_lens_cpu[one] if fb.extend_seq_lens_cpu else None,
        extend_prefix_lens_cpu=(fb.extend_prefix_lens_cpu[one]
                                if fb.extend_prefix_lens_cpu else None),
        last_token_indices=(torch.tensor([end - start - 1], dtype=torch.int64,
                                         device=fb.input_ids.device)
                            if fb.last_token_indices is not None else None),
        return_all_logits=fb.return_all_logits,
        **_sub_logit_rows(fb, i, start, end),
    )


def _sub_logit_rows(fb: ForwardBatch, i: int, start: int, end: int) -> dict:
    """Row i's group of `fb.logit_rows`, relative to its own tokens."""
    if fb.logit_rows is None:
        return {}
    first = sum(fb.logit_counts_cpu[:i])
    rows = fb.logit_rows[first:first + fb.logit_counts_cpu[i]] - start
    return {"logit_rows": rows, "logit_counts_cpu": [int(rows.numel())]}
