"""Merged projections: one q/k/v layer and one gate/up layer equal the separate layers, with
float weights and with GGML blocks (one kind, mixed kinds, the packed kernels and the chunked
dequantized path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from airserve.srt.distributed.sharding import column_shard, qkv_shards
from airserve.srt.layers.linear import Linear
from airserve.srt.layers.parallel_linear import ColumnLinear
from airserve.srt.layers.quant import block_matvec
from airserve_testing.tiny_gguf import any_packed as random_packed

# Packed products equal the dequantized weights' up to float32 summation order.
ATOL = 1e-4


@pytest.fixture(autouse=True)
def _kernels():
    if not block_matvec.kernels_available():
        pytest.fail(f"the block kernels did not build: {block_matvec.unavailable_reason()}")


def test_float_qkv_equals_separate_layers() -> None:
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, hidden = 4, 2, 16, 64
    full = {n: torch.randn(rows, hidden, generator=g) for n, rows in
            (("q_proj", heads * d), ("k_proj", kv_heads * d), ("v_proj", kv_heads * d))}
    bias = {n: torch.randn(w.shape[0], generator=g) for n, w in full.items()}
    layer = ColumnLinear(hidden, qkv_shards(heads, kv_heads, d, 0, 1), bias=True)
    for n in full:
        layer.load(n, "weight", full[n])
        layer.load(n, "bias", bias[n])
    x = torch.randn(5, hidden, generator=g)
    want = torch.cat([F.linear(x, full[n], bias[n]) for n in ("q_proj", "k_proj", "v_proj")], -1)
    torch.testing.assert_close(layer(x), want, atol=0, rtol=0)


@pytest.mark.parametrize("kinds,k", [(("q4_1", "q4_1"), 64), (("q8_0", "q8_0"), 64),
                                     (("q4_1", "q8_0"), 64), (("q4_k", "q5_1"), 256),
                                     (("q6_k", "q6_k"), 256)])
@pytest.mark.parametrize("drop", [False, True])
def test_packed_gate_up_equals_separate_layers(kinds, k, drop) -> None:
    """gate/up blocks stacked (one segment per run of one kind) give the separate layers'
    outputs, through the packed kernels (rows <= 4) and above them (float or dequantized)."""
    inter = 40
    parts = [random_packed(kind, inter, k, seed=i) for i, kind in enumerate(kinds)]
    separate = []
    for p in parts:
        lin = Linear(k, inter, bias=False)
        with torch.no_grad():
            lin.weight.copy_(p.dequantize())
        lin.attach_packed(p, 4, drop_weight=drop)
        separate.append(lin)
    merged = ColumnLinear(k, [column_shard(n, inter, 0, 1) for n in ("gate_proj", "up_proj")])
    if not drop:
        for name, p in zip(("gate_proj", "up_proj"), parts):
            merged.load(name, "weight", p.dequantize())
    merged.attach_packed(merged.shard_packed(dict(zip(("gate_proj", "up_proj"), parts))), 4,
                         drop_weight=drop)
    assert merged.packed_kinds == tuple(dict.fromkeys(kinds)) if kinds[0] == kinds[1] \
        else merged.packed_kinds == kinds
    assert merged.weight_bytes(1) == sum(p.nbytes for p in parts)
    for rows in (1, 3, 7):  # 7 > 4: float weights, or the blocks dequantized in chunks
        x = torch.randn(rows, k)
        want = torch.cat([lin(x) for lin in separate], dim=-1)
        torch.testing.assert_close(merged(x), want, atol=ATOL, rtol=ATOL)
