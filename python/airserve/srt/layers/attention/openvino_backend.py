"""Paged decode attention in plain torch ops that OpenVINO converts, for `OpenVINORunner`.

The OpenVINO graph must not write the KV cache: in-place writes inside it are lost
(docs/design.md, "Facts the code relies on"). So decode attention here reads only the cached
tokens, through the block table, and attends to the new token's K/V separately; it hands the
new K/V back through the metadata, the graph returns them, and the runner writes them into the
cache after the call.

The block table's width is the step's KV-length bucket (not the full context; a dynamic
dimension of the graph), so a step gathers `bs * kv_len` tokens per layer, whatever the pool
size or context length. Two
OpenVINO habits shape the ops (both cost the whole pool or more every step otherwise, and
`OpenVINORunner` checks the compiled graph for the first): it moves an elementwise op with a
constant scalar operand in front of a gather, onto the gathered-from tensor; and its Transpose
is slow, so K and V are gathered head-major instead of transposed after the gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from airserve.srt.forward_batch import ForwardBatch
from airserve.srt.layers.attention.base import AttentionBackend


@dataclass
class OpenVINODecodeMetadata:
    """What one compiled decode step reads beside the model inputs, and the K/V it returns."""

    block_table: torch.Tensor  # [bs, kv_blocks] int32 page ids; kv_blocks * page_size = kv_len
    seq_lens: torch.Tensor  # [bs] int32, including the new token
    new_k: list[torch.Tensor] = field(default_factory=list)  # per layer [bs, KVH, D]
    new_v: list[torch.Tensor] = field(default_factory=list)


def decode_attention_with_new_token(
    q: torch.Tensor,  # [bs, H, D]
    k: torch.Tensor,  # [bs, KVH, D], the new token's key (not in the cache yet)
    v: torch.Tensor,  # [bs, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [bs, kv_blocks] int32
    seq_lens: torch.Tensor,  # [bs] int32, including the new token
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """Attention of each new token over its cached tokens and itself: [bs, H, D]."""
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # kv_len = block-table columns * page_size is symbolic in the compiled graph (one graph
    # serves every KV length), so it appears in views as -1 and is never a slice bound.
    offsets = torch.arange(page_size, dtype=torch.int64, device=q.device)
    slots = (block_table.to(torch.int64)[:, :, None] * page_size + offsets).reshape(bs, 1, -1)
    heads = torch.arange(num_kv_heads, dtype=torch.int64, device=q.device)
    rows = (slots * num_kv_heads + heads[None, :, None]).reshape(-1)  # [bs * KVH * kv_len]
    shape = (bs, num_kv_heads, -1, head_dim)
    keys = k_cache.reshape(-1, head_dim).index_select(0, rows).view(shape).float()
    values = v_cache.reshape(-1, head_dim).index_select(0, rows).view(shape).float()

    # Scale q, not the scores: OpenVINO moves a scalar multiply of the gathered keys in front of
    # the gather, onto the whole KV pool, every step.
    qg = q.view(bs, num_kv_heads, group, head_dim).float() * scale  # [bs, KVH, G, D]
    cached = torch.matmul(qg, keys.transpose(2, 3))  # [bs, KVH, G, kv_len]
    # The cache holds seq_len - 1 tokens of each row; later columns are other pages or padding.
    positions = torch.arange(keys.shape[2], dtype=torch.int64, device=q.device)
    valid = positions[None, :] < (seq_lens.to(torch.int64) - 1)[:, None]  # [bs, kv_len]
    cached = cached.masked_fill(~valid[:, None, None, :], float("-inf"))
    own = (qg * k.float()[:, :, None, :]).sum(-1, keepdim=True)  # [bs, KVH, G, 1], not masked
    # Softmax over the cached scores and the token's own one, written out (no concatenation
    # and slicing at a symbolic length).
    top = torch.maximum(cached.amax(-1, keepdim=True), own)
    weights = torch.exp(cached - top)
    own_weight = torch.exp(own - top)
    total = weights.sum(-1, keepdim=True) + own_weight
    out = (torch.matmul(weights, values) + own_weight * v.float()[:, :, None, :]) / total
    return out.reshape(bs, num_heads, head_dim).to(q.dtype)


class OpenVINOAttnBackend(AttentionBackend):
    """Decode-only backend used inside OpenVINO graphs; metadata is `OpenVINODecodeMetadata`.

    Prefill never runs in these graphs: the model runner's own backend serves it eagerly.
    """

    def forward_decode(self, q, k, v, layer_id: int, scale: float, fb: ForwardBatch):
        meta: OpenVINODecodeMetadata = fb.attn_metadata
        cache = fb.kv_cache
        meta.new_k.append(k)
        meta.new_v.append(v)
        return decode_attention_with_new_token(
            q, k, v, cache.k_buffers[layer_id], cache.v_buffers[layer_id], meta.block_table,
            meta.seq_lens, cache.page_size, scale,
        )

    def forward_extend(self, q, k, v, layer_id: int, scale: float, fb: ForwardBatch):
        raise NotImplementedError("OpenVINOAttnBackend runs decode graphs only; prefill runs "
                                  "eagerly in the model runner's attention backend")
