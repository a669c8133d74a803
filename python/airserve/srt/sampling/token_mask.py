"""Grammar token masks on a batch of logits: disallowed tokens become -inf before sampling.

Applied to the logits the forward (eager or a graph replay) returned, outside any graph, for
greedy and sampled rows alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def apply_grammar_masks(logits: torch.Tensor, grammars: Sequence) -> None:
    """`logits` [rows, vocab] in place; `grammars[i]` is row i's GrammarState or None."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(grammars), logits.shape[-1])
    for i in rows:
        grammars[i].fill_mask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    indices=rows)
