"""Tensor-parallel linear layers, which are also the model's layers at one rank.

`ColumnLinear` holds this rank's rows of one or more checkpoint tensors side by side: q/k/v as
one layer (`qkv_proj`), gate/up as one (`gate_up_proj`), lm_head's slice of the vocabulary.
One product serves them all, with float weights or with merged GGML blocks. `RowLinear` holds
this rank's slice of the input dimension (o_proj, down_proj) and sums the ranks' partial
products. At tp size 1 both are plain linear layers.
"""

from __future__ import annotations

import torch

from airserve.srt.distributed.parallel_state import SINGLE, TPGroup
from airserve.srt.distributed.sharding import (
    Shard,
    packed_cols,
    packed_rows,
    split_evenly,
    take_rows,
)
from airserve.srt.layers.linear import Linear
from airserve.srt.layers.quant.block_matvec import PackedWeight


def _check_cols(name: str, full: torch.Tensor, cols: int | None) -> None:
    if full.dim() == 2 and cols is not None and full.shape[1] != cols:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(full.shape)}, the model "
                         f"expects {cols} input columns")


class ColumnLinear(Linear):
    """Output rows: the rank's shard of each checkpoint tensor in `shards`, in order."""

    def __init__(self, in_features: int, shards: list[Shard], bias: bool = False) -> None:
        super().__init__(in_features, sum(s.size for s in shards), bias=bias)
        self.shards = list(shards)

    @property
    def part_names(self) -> list[str]:
        return [s.name for s in self.shards]

    def load(self, part: str, field: str, full: torch.Tensor, name: str = "") -> None:
        """Copy this rank's rows of checkpoint tensor `part` (`field` "weight" or "bias")."""
        row0 = 0
        for shard in self.shards:
            if shard.name == part:
                break
            row0 += shard.size
        else:
            raise KeyError(f"{part!r} is not a part of this layer ({self.part_names})")
        if full.shape[0] != shard.total:
            raise ValueError(f"checkpoint tensor {name or part!r} has {full.shape[0]} rows, "
                             f"the model expects {shard.total}")
        _check_cols(name or part, full, self.in_features if field == "weight" else None)
        param = getattr(self, field)
        with torch.no_grad():
            param[row0:row0 + shard.size].copy_(take_rows(full, shard.start, shard.size))

    def shard_packed(self, parts: dict[str, PackedWeight]) -> list[PackedWeight]:
        """This rank's block rows of each part (full checkpoint blocks by part name)."""
        return [packed_rows(parts[s.name], s.start, s.size) for s in self.shards]


class RowLinear(Linear):
    """Input columns: the rank's equal share of `in_total`; the output is summed over ranks."""

    def __init__(self, in_total: int, out_features: int, name: str, bias: bool = False,
                 tp: TPGroup = SINGLE) -> None:
        self.col0, cols = split_evenly(in_total, tp.rank, tp.size, f"{name} input size")
        super().__init__(cols, out_features, bias=bias)
        self.part_names = [name]
        self.in_total = in_total
        self.tp = tp

    def load(self, part: str, field: str, full: torch.Tensor, name: str = "") -> None:
        """Copy this rank's columns of the weight; the bias goes to rank 0 only (the others
        hold zeros, so the sum over ranks adds it once)."""
        param = getattr(self, field)
        if field == "bias":
            value = full if self.tp.rank == 0 else torch.zeros_like(full)
        else:
            if tuple(full.shape) != (self.out_features, self.in_total):
                raise ValueError(f"checkpoint tensor {name or part!r} has shape "
                                 f"{tuple(full.shape)}, the model expects "
                                 f"{(self.out_features, self.in_total)}")
            value = full[:, self.col0:self.col0 + self.in_features]
        with torch.no_grad():
            param.copy_(value)

    def shard_packed(self, parts: dict[str, PackedWeight]) -> list[PackedWeight]:
        (packed,) = parts.values()
        return [packed_cols(packed, self.col0, self.in_features)]

    def forward(self, x: torch.Tensor, decode: bool = False,
                float_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x, decode, float_rows=float_rows))

    def forward_bf16(self, xb: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward_bf16(xb, err))
