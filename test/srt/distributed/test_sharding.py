"""Tensor-parallel sharding against unsharded weights, for every layer kind and block kind:
the ranks' column shards side by side, and the sum of the ranks' row-parallel partial
products, equal the full layer (pure tensor code: no processes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from airserve.srt.distributed.parallel_state import TPGroup
from airserve.srt.distributed.sharding import (
    column_shard,
    packed_cols,
    packed_rows,
    qkv_shards,
    vocab_shard,
)
from airserve.srt.layers.embedding import VocabParallelEmbedding
from airserve.srt.layers.linear import Linear
from airserve.srt.layers.parallel_linear import ColumnLinear, RowLinear
from airserve.srt.layers.quant import block_matvec
from airserve_testing.tiny_gguf import any_packed as random_packed

ATOL = 1e-4  # float32 summation order (packed products, partial sums over ranks)
KINDS = [("q4_1", 64), ("q8_0", 64), ("q5_0", 64), ("q4_k", 512), ("q6_k", 512)]


@pytest.fixture(autouse=True)
def _kernels():
    if not block_matvec.kernels_available():
        pytest.fail(f"the block kernels did not build: {block_matvec.unavailable_reason()}")


@pytest.mark.parametrize("tp,kv_heads", [(2, 2), (2, 4), (4, 2), (4, 1)])
def test_qkv_shards_cover_heads_and_replicate_kv(tp, kv_heads) -> None:
    heads, d, hidden = 8, 16, 32
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(r * d, hidden, generator=g) for n, r in
            (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads))}
    x = torch.randn(3, hidden, generator=g)
    q_parts, k_seen = [], []
    for rank in range(tp):
        layer = ColumnLinear(hidden, qkv_shards(heads, kv_heads, d, rank, tp))
        for n, w in full.items():
            layer.load(n, "weight", w)
        nq = heads // tp * d
        nkv = max(1, kv_heads // tp) * d
        q, k, v = layer(x).split((nq, nkv, nkv), dim=-1)
        q_parts.append(q)
        # Rank r's query heads attend to the KV heads HF's grouping gives them.
        first_q_head = rank * heads // tp
        kv_head = first_q_head // (heads // kv_heads)
        want_k = F.linear(x, full["k_proj"][kv_head * d:kv_head * d + nkv])
        torch.testing.assert_close(k, want_k, atol=0, rtol=0)
        k_seen += range(kv_head, kv_head + nkv // d)
    torch.testing.assert_close(torch.cat(q_parts, -1), F.linear(x, full["q_proj"]),
                               atol=0, rtol=0)
    assert sorted(set(k_seen)) == list(range(kv_heads))  # every KV head is held somewhere


def test_uneven_splits_are_refused() -> None:
    with pytest.raises(ValueError, match="num_attention_heads.*--tp-size 3"):
        qkv_shards(8, 2, 16, 0, 3)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        qkv_shards(12, 4, 16, 0, 6)
    with pytest.raises(ValueError, match="down_proj input size"):
        RowLinear(100, 8, "down_proj", tp=TPGroup(0, 3))


@pytest.mark.parametrize("kind,k", KINDS)
@pytest.mark.parametrize("tp", [2, 4])
def test_packed_column_and_row_shards_equal_the_full_product(kind, k, tp) -> None:
    """Block rows per rank (column-parallel) side by side, and block columns per rank
    (row-parallel) summed, give the unsharded block product."""
    n = 24
    w = random_packed(kind, n, k, seed=3)
    dense = w.dequantize()
    x = torch.randn(2, k)
    full = x @ dense.T
    cols = [block_matvec.packed_linear(x, packed_rows(w, *_even(n, r, tp)))
            for r in range(tp)]
    torch.testing.assert_close(torch.cat(cols, -1), full, atol=ATOL, rtol=ATOL)
    values = block_matvec.RAW_KINDS.get(kind, (32,))[0]
    if (k // tp) % values:
        with pytest.raises(ValueError, match=f"multiple of {values}"):
            packed_cols(w, 0, k // tp)
        return
    total = torch.zeros_like(full)
    for r in range(tp):
        start, size = _even(k, r, tp)
        part = packed_cols(w, start, size)
        torch.testing.assert_close(part.dequantize(), dense[:, start:start + size])
        total += block_matvec.packed_linear(x[:, start:start + size].contiguous(), part)
    torch.testing.assert_close(total, full, atol=ATOL, rtol=ATOL)


def test_packed_row_split_off_a_block_boundary_is_refused() -> None:
    w = random_packed("q4_1", 8, 96)
    with pytest.raises(ValueError, match="multiple of 32"):
        packed_cols(w, 48, 48)  # --tp-size 2 of K=96: 48 is not a multiple of 32


@pytest.mark.parametrize("bias", [False, True])
def test_row_linear_partials_sum_to_the_full_layer(bias) -> None:
    g = torch.Generator().manual_seed(1)
    full_w, full_b = torch.randn(16, 64, generator=g), torch.randn(16, generator=g)
    x = torch.randn(3, 64, generator=g)
    total = 0
    for rank in range(2):
        layer = RowLinear(64, 16, "o_proj", bias=bias, tp=TPGroup(rank, 2))
        layer.load("o_proj", "weight", full_w)
        if bias:
            layer.load("o_proj", "bias", full_b)
        xr = x[:, layer.col0:layer.col0 + layer.in_features]
        total = total + Linear.forward(layer, xr)  # the partial product, before all-reduce
    torch.testing.assert_close(total, F.linear(x, full_w, full_b if bias else None),
                               atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("tp", [2, 3])
def test_vocab_shards_embed_and_project_like_the_full_table(tp) -> None:
    """Embedding lookups summed over ranks equal the full lookup; lm_head logits of the ranks
    side by side, cut to the vocabulary, equal the full logits (vocab 301: padded shards)."""
    vocab, hidden = 301, 16
    g = torch.Generator().manual_seed(2)
    table = torch.randn(vocab, hidden, generator=g)
    ids = torch.tensor([0, 5, 100, 150, 200, 300])
    h = torch.randn(4, hidden, generator=g)
    looked, logits = 0, []
    for rank in range(tp):
        emb = VocabParallelEmbedding(vocab, hidden, TPGroup(rank, tp))
        emb.load(table)
        s = emb.shard
        local = ids - s.start
        inside = (local >= 0) & (local < s.size)
        looked = looked + F.embedding(torch.where(inside, local, 0), emb.weight) * inside[:, None]
        head = ColumnLinear(hidden, [vocab_shard(vocab, rank, tp, "lm_head")])
        head.load("lm_head", "weight", table)
        logits.append(head(h))
    torch.testing.assert_close(looked, table[ids], atol=0, rtol=0)
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], h @ table.T, atol=ATOL,
                               rtol=ATOL)


def test_gate_up_column_shards() -> None:
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    x = torch.randn(2, 32, generator=g)
    outs = []
    for rank in range(2):
        layer = ColumnLinear(32, [column_shard(n, 64, rank, 2) for n in ("gate_proj", "up_proj")])
        layer.load("gate_proj", "weight", gate)
        layer.load("up_proj", "weight", up)
        outs.append(layer(x).chunk(2, dim=-1))
    torch.testing.assert_close(torch.cat([o[0] for o in outs], -1), x @ gate.T)
    torch.testing.assert_close(torch.cat([o[1] for o in outs], -1), x @ up.T)


def _even(total: int, rank: int, size: int) -> tuple[int, int]:
    return rank * total // size, total // size
