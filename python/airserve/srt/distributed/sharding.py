"""Which rows and columns of a checkpoint tensor a tensor-parallel rank holds, and the slicing
itself, for float tensors and for GGUF block weights (`PackedWeight`) alike.

Column-parallel layers (q/k/v, gate/up, lm_head) split output rows: a block weight's blocks lie
along a row, so a row slice of its `qs`/`d`/`m` is a valid block weight. Row-parallel layers
(o_proj, down_proj) split the input dimension K, which must fall on a block boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from airserve.srt.layers.quant.block_matvec import BLOCK, RAW_KINDS, PackedWeight


@dataclass(frozen=True)
class Shard:
    """Rows [start, start + size) of the checkpoint tensor `name` (its last name part, e.g.
    "q_proj") of `total` rows, held by this rank; rows past `total` are zero padding."""

    name: str
    start: int
    size: int
    total: int


def split_evenly(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """(start, count) of rank's equal part of `total`; `what` names it in the error."""
    if total % size:
        raise ValueError(f"{what} ({total}) is not divisible by --tp-size {size}")
    part = total // size
    return rank * part, part


def qkv_shards(num_heads: int, num_kv_heads: int, head_dim: int, rank: int, size: int
               ) -> list[Shard]:
    """Rows of q/k/v for `rank`: q heads split evenly; k/v heads split evenly, or, when there
    are fewer KV heads than ranks, each rank holds one, shared by size / num_kv_heads ranks."""
    q0, nq = split_evenly(num_heads, rank, size, "num_attention_heads")
    if num_kv_heads >= size:
        kv0, nkv = split_evenly(num_kv_heads, rank, size, "num_key_value_heads")
    else:
        if size % num_kv_heads:
            raise ValueError(f"--tp-size {size} is not a multiple of num_key_value_heads "
                             f"({num_kv_heads}), so KV heads cannot be replicated evenly")
        kv0, nkv = rank * num_kv_heads // size, 1
    kv = num_kv_heads * head_dim
    return [Shard("q_proj", q0 * head_dim, nq * head_dim, num_heads * head_dim),
            Shard("k_proj", kv0 * head_dim, nkv * head_dim, kv),
            Shard("v_proj", kv0 * head_dim, nkv * head_dim, kv)]


def column_shard(name: str, total: int, rank: int, size: int) -> Shard:
    """Rank's equal part of the output rows of `name`."""
    start, part = split_evenly(total, rank, size, f"{name} output size")
    return Shard(name, start, part, total)


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads each rank holds (and caches)."""
    return max(1, num_kv_heads // size)


def vocab_shard(vocab: int, rank: int, size: int, name: str) -> Shard:
    """Rank's rows of a vocabulary-sized tensor: ceil(vocab / size) each, the last padded."""
    per = -(-vocab // size)
    return Shard(name, rank * per, per, vocab)


def take_rows(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """t[start:start + size] along dim 0, zero-padded past the end."""
    part = t[start:start + size]
    if part.shape[0] < size:
        pad = [0, 0] * (t.dim() - 1) + [0, size - part.shape[0]]
        part = F.pad(part, pad)
    return part.contiguous()


def packed_rows(w: PackedWeight, start: int, size: int) -> PackedWeight:
    """Output rows [start, start + size) of a block weight; zero rows past the end (blocks of
    zero bytes hold zeros in every kind: each value is a multiple of its block's scale)."""
    def rows(t):
        return None if t is None else take_rows(t, start, size)

    return PackedWeight(w.kind, rows(w.qs), rows(w.d), rows(w.m))


def block_values(kind: str) -> int:
    """Values per block along K of a block kind."""
    return RAW_KINDS[kind][0] if kind in RAW_KINDS else BLOCK


def packed_cols(w: PackedWeight, start: int, size: int) -> PackedWeight:
    """Input columns [start, start + size) of a block weight; both must fall on the kind's
    block boundary, else ValueError (the layer cannot be split there)."""
    values = block_values(w.kind)
    if start % values or size % values:
        raise ValueError(
            f"cannot split a {w.kind} weight at input columns {start}..{start + size}: "
            f"blocks hold {values} values, so each rank's share of K must be a multiple of "
            f"{values}; choose a --tp-size that divides K into such parts")
    b0, nb = start // values, size // values
    if w.kind in RAW_KINDS:
        per = RAW_KINDS[w.kind][1]
        qs = w.qs[:, b0 * per:(b0 + nb) * per]
    else:
        per = BLOCK // 2 if w.kind == "q4_1" else BLOCK
        qs = w.qs[:, b0 * per:(b0 + nb) * per]

    def cols(t):
        return None if t is None else t[:, b0:b0 + nb].contiguous()

    return PackedWeight(w.kind, qs.contiguous(), cols(w.d), cols(w.m))
