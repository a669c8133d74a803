"""Turns logits into next tokens, one row per request."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from airserve.srt.sampling.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, params: SamplingParams,
                    prompt_ids: Sequence[int], output_ids: Sequence[int]) -> torch.Tensor:
    """Penalties on one row [vocab] (float32), OpenAI/SGLang semantics."""
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.int64,
                            device=logits.device)
        if seen.numel():
            vals = logits[seen]
            p = params.repetition_penalty
            logits[seen] = torch.where(vals > 0, vals / p, vals * p)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        ids = torch.tensor(output_ids, dtype=torch.int64, device=logits.device)
        counts = torch.bincount(ids, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= params.frequency_penalty * counts
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def sample_row(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None) -> int:
    """One token from one row [vocab] float32, after penalties."""
    if params.is_greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, logits.shape[-1])
        kth = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = (cum - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
           generators: Sequence[torch.Generator | None],
           banned: Sequence[Sequence[int]] | None = None) -> list[int]:
    """logits: [bs, vocab] float32. Returns one token id per row.

    `banned[i]` lists ids row i may not produce this step (EOS before min_new_tokens).
    """
    simple = all(p.is_greedy and not p.has_penalties for p in params) and not any(banned or ())
    if simple:
        return torch.argmax(logits, dim=-1).tolist()
    out = []
    for i, p in enumerate(params):
        row = logits[i].clone()
        if p.has_penalties:
            row = apply_penalties(row, p, prompt_ids[i], output_ids[i])
        if banned and banned[i]:
            row[list(banned[i])] = float("-inf")
        out.append(sample_row(row, p, generators[i]))
    return out
