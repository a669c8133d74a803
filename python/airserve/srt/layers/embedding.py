"""The token embedding, split over tensor-parallel ranks by vocabulary rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from airserve.srt.distributed.parallel_state import SINGLE, TPGroup
from airserve.srt.distributed.sharding import take_rows, vocab_shard


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + per) of the embedding table (ceil(vocab / tp) each, the last rank's
    padded with zeros). A token outside the rank's rows looks up zeros; the sum over ranks is
    the full lookup."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.shard = vocab_shard(vocab_size, tp.rank, tp.size, "embed_tokens")
        self.vocab_size = vocab_size
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(self.shard.size, hidden_size))

    def load(self, full: torch.Tensor, name: str = "embed_tokens") -> None:
        if tuple(full.shape) != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(full.shape)}, the "
                             f"model expects {(self.vocab_size, self.weight.shape[1])}")
        with torch.no_grad():
            self.weight.copy_(take_rows(full, self.shard.start, self.shard.size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.shard.start
        inside = (local >= 0) & (local < self.shard.size)
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)
