"""Turns logits into next tokens, one row per request.

Numerically safe for every accepted parameter value: a row is sampled in float64 after its
largest logit is subtracted, so a tiny temperature tends to argmax (never inf/inf), a huge one to
uniform, and penalties at their bounds cannot produce NaN. Rows whose temperature is below
`GREEDY_TEMPERATURE` are greedy outright. No NaN or all-zero distribution reaches
`torch.multinomial`: such a row raises `SamplingError`, which the scheduler turns into an error
for that request alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from airserve.srt.layers import cpu_kernels
from airserve.srt.sampling.sampling_params import SamplingParams

# Greedy rows' argmax on the host CPU (csrc/logits.cpp): the first largest value's index, or
# the first NaN's, as torch.max's indices; _portable is its plain loop, for tests.
_lib = torch.library.Library("airserve", "FRAGMENT")
_lib.define("argmax_rows(Tensor logits) -> Tensor")
_lib.define("argmax_rows_portable(Tensor logits) -> Tensor")

# Below this temperature a row is argmax (as SGLang): dividing by it only amplifies rounding.
GREEDY_TEMPERATURE = 1e-6
# Above this, the distribution is uniform over the finite logits to float64 precision anyway;
# the cap keeps -inf / inf (= NaN) out of the division.
MAX_TEMPERATURE = 1e30


class SamplingError(RuntimeError):
    """A row's logits admit no token (all -inf or NaN): a model or request fault, per row."""


def apply_penalties(logits: torch.Tensor, params: SamplingParams,
                    prompt_ids: Sequence[int], output_ids: Sequence[int]) -> torch.Tensor:
    """Penalties on one row [vocab], in place (OpenAI/SGLang semantics); float64 expected, so
    that a repetition penalty near 0 gives large finite values, not inf."""
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.int64,
                            device=logits.device)
        if seen.numel():
            vals = logits[seen]
            p = float(params.repetition_penalty)
            logits[seen] = torch.where(vals > 0, vals / p, vals * p)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        ids = torch.tensor(output_ids, dtype=torch.int64, device=logits.device)
        counts = torch.bincount(ids, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= float(params.frequency_penalty) * counts
        logits -= float(params.presence_penalty) * (counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """OpenAI's logit_bias on one row [vocab], in place: `bias[id]` is added to that token's
    logit (ids were checked against the vocabulary when the request arrived)."""
    ids = torch.tensor(list(bias), dtype=torch.int64, device=logits.device)
    logits[ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def _finite_row(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf (never chosen), +inf -> the largest float (ties with other +inf); raises
    when nothing is left to choose."""
    big = torch.finfo(logits.dtype).max
    row = torch.nan_to_num(logits, nan=float("-inf"), posinf=big, neginf=float("-inf"))
    if not bool(torch.isfinite(row).any()):
        raise SamplingError("every logit of this row is -inf or NaN; no token can be sampled")
    return row


def sample_row(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None) -> int:
    """One token from one row [vocab] (penalties already applied)."""
    if generator is not None and generator.device != logits.device:
        logits = logits.to(generator.device)  # a seeded request's generator lives on the host
    row = _finite_row(logits.to(torch.float64))
    if params.is_greedy or params.temperature < GREEDY_TEMPERATURE:
        return int(torch.argmax(row))
    # <= 0 everywhere, 0 at the max: dividing by any temperature keeps the max at exp(0) = 1.
    row = (row - row.max()) / min(float(params.temperature), MAX_TEMPERATURE)
    if params.top_k > 0:
        k = min(params.top_k, row.shape[-1])
        kth = torch.topk(row, k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < float(params.min_p) * probs.max(), 0.0)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token: the
        # first one's preceding mass is exactly 0).
        drop = (cum - sorted_probs) >= float(params.top_p)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if not (bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0):
        raise SamplingError(f"no valid distribution for temperature={params.temperature}, "
                            f"top_p={params.top_p}, top_k={params.top_k}, min_p={params.min_p}")
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
           generators: Sequence[torch.Generator | None],
           banned: Sequence[Sequence[int]] | None = None) -> list[int]:
    """logits: [bs, vocab] float32. Returns one token id per row.

    `banned[i]` lists ids row i may not produce this step (EOS before min_new_tokens).
    """
    simple = all(p.is_greedy and not p.has_penalties and not p.logit_bias for p in params) \
        and not any(banned or ())
    if simple:
        return greedy_tokens(logits)
    return [sample_one(logits[i], p, prompt_ids[i], output_ids[i], generators[i],
                       banned[i] if banned else ())
            for i, p in enumerate(params)]


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax: the first largest logit (a NaN counts as largest)."""
    if (logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0
            and logits.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()):
        # [64, 49152] float32, 2 threads, AMD EPYC: ~0.2 against ~1.8 ms for torch's max.
        return torch.ops.airserve.argmax_rows(logits).tolist()
    # max's indices are argmax's, in half the time on CPU (0.9 against 1.8 ms).
    return logits.max(dim=-1).indices.tolist()


def sample_one(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
               output_ids: Sequence[int], generator: torch.Generator | None,
               banned: Sequence[int] = ()) -> int:
    """One row [vocab]: penalties, banned ids, then `sample_row`. Does not modify `logits`."""
    row = logits.to(torch.float64, copy=True)  # penalties work in place
    if params.has_penalties:
        row = apply_penalties(row, params, prompt_ids, output_ids)
    if params.logit_bias:
        row = apply_logit_bias(row, params.logit_bias)
    if banned:
        row[list(banned)] = float("-inf")
    return sample_row(row, params, generator)
