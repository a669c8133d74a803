"""Log probabilities of tokens, from the logits the forward pass already returned.

Which distribution: the model's own, `log_softmax` of its float32 logits, taken before any
sampling transform (logit_bias, penalties, temperature, top-k / top-p / min-p, banned ids).
So a logprob does not depend on how the token was sampled, and equals what an evaluation
harness computes from the model alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the HTTP process imports this module for its dataclasses, without torch
    import torch

# (logprob, token id) pairs of the most likely tokens at one position, best first.
TopLogprobs = list[tuple[float, int]]


@dataclass(frozen=True)
class LogprobParams:
    """What a request asks for (SGLang's names). `logprob_start_len` is the first prompt
    position listed in `input_token_logprobs`; -1: the last prompt token only."""

    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1

    def start(self, prompt_len: int) -> int:
        """The resolved first listed prompt position, in [0, prompt_len)."""
        return prompt_len - 1 if self.logprob_start_len < 0 else self.logprob_start_len


@dataclass
class TokenLogprob:
    """One position: the logprob of `token_id`, and the top ones (None when not asked)."""

    logprob: float
    token_id: int
    top: TopLogprobs | None = None


def token_logprobs(logits: torch.Tensor, token_ids: list[int],
                   top_k: int = 0) -> list[TokenLogprob]:
    """logits: [rows, vocab] float32 (not modified); token_ids: one per row. The logprob of
    each row's token under log_softmax of its row, and its `top_k` best (k > 0)."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logp.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
    if top_k <= 0:
        return [TokenLogprob(v, t) for v, t in zip(chosen, token_ids)]
    vals, idx = torch.topk(logp, min(top_k, logp.shape[-1]), dim=-1)
    return [TokenLogprob(v, t, list(zip(tv, ti)))
            for v, t, tv, ti in zip(chosen, token_ids, vals.tolist(), idx.tolist())]
