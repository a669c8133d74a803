"""Paged attention in plain torch, for CPU (eager and inside compiled decode graphs).

Decode is one custom op: inside a compiled graph it is opaque, so the graph's shapes stay fixed
(block table padded to the maximum length) while the op reads only the live part of each block
table. Cost per step follows the live context, not the padded width nor the pool size.
"""

from __future__ import annotations

import torch

from airserve.srt.layers.attention.base import AttentionBackend
from airserve.srt.model_executor.forward_batch import ForwardBatch


@torch.library.custom_op("airserve::paged_decode_attention", mutates_args=("k_cache", "v_cache"))
def paged_decode_attention(
    q: torch.Tensor,  # [bs, H, D]
    k: torch.Tensor,  # [bs, KVH, D], the new token's key
    v: torch.Tensor,  # [bs, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,  # [bs] int64
    block_table: torch.Tensor,  # [bs, max_blocks] int32
    seq_lens: torch.Tensor,  # [bs] int32, including the new token
    page_size: int,
    scale: float,
) -> torch.Tensor:
    k_cache.index_copy_(0, out_cache_loc, k.to(k_cache.dtype))
    v_cache.index_copy_(0, out_cache_loc, v.to(v_cache.dtype))
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    live = int(seq_lens.max())
    slots = _live_slots(block_table, live, page_size)  # [bs, live]
    keys = k_cache[slots]  # [bs, live, KVH, D]
    values = v_cache[slots]
    group = num_heads // num_kv_heads
    # Group query heads by their KV head: [bs, KVH, group, D] @ [bs, KVH, D, live].
    qg = q.view(bs, num_kv_heads, group, head_dim).to(keys.dtype)
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float() * scale
    mask = torch.arange(live, device=q.device)[None, :] >= seq_lens[:, None].to(torch.int64)
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [bs, KVH, group, D]
    return out.reshape(bs, num_heads, head_dim).to(q.dtype)


@paged_decode_attention.register_fake
def _(q, k, v, k_cache, v_cache, out_cache_loc, block_table, seq_lens, page_size, scale):
    return torch.empty_like(q)


def _live_slots(block_table: torch.Tensor, live: int, page_size: int) -> torch.Tensor:
    """KV slots of the first `live` positions of every row: [bs, live] int64."""
    if page_size == 1:
        return block_table[:, :live].to(torch.int64)
    blocks = -(-live // page_size)
    offsets = torch.arange(page_size, device=block_table.device)
    slots = block_table[:, :blocks, None].to(torch.int64) * page_size + offsets
    return slots.flatten(1)[:, :live]


class TorchNativeAttnBackend(AttentionBackend):
    def forward_decode(self, q, k, v, layer_id: int, scale: float, fb: ForwardBatch):
        cache = fb.kv_cache
        return paged_decode_attention(
            q, k, v, cache.k_buffers[layer_id], cache.v_buffers[layer_id], fb.out_cache_loc,
            fb.attn_metadata, fb.seq_lens, cache.page_size, scale,
        )

    def forward_extend(self, q, k, v, layer_id: int, scale: float, fb: ForwardBatch):
        k_cache = fb.kv_cache.k_buffers[layer_id]
        v_cache = fb.kv_cache.v_buffers[layer_id]
        k_cache.index_copy_(0, fb.out_cache_loc, k.to(k_cache.dtype))
        v_cache.index_copy_(0, fb.out_cache_loc, v.to(v_cache.dtype))
        req_to_token = self.allocator.req_to_token
        out = torch.empty_like(q)
        start = 0
        for i in range(fb.batch_size):
            prefix = fb.extend_prefix_lens_cpu[i]
            new = fb.extend_seq_lens_cpu[i]
            total = prefix + new
            slots = req_to_token[fb.req_pool_indices[i], :total].to(torch.int64)
            keys = k_cache[slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, total, D]
            values = v_cache[slots].transpose(0, 1).unsqueeze(0)
            query = q[start:start + new].transpose(0, 1).unsqueeze(0)  # [1, H, new, D]
            # Query j sits at absolute position prefix + j and sees keys 0..prefix + j.
            mask = None
            if prefix:
                rows = torch.arange(new, device=q.device)[:, None] + prefix
                mask = torch.arange(total, device=q.device)[None, :] <= rows
            o = torch.nn.functional.scaled_dot_product_attention(
                query.to(keys.dtype), keys, values, attn_mask=mask, is_causal=mask is None,
                scale=scale, enable_gqa=True,
            )
            out[start:start + new] = o[0].transpose(0, 1).to(q.dtype)
            start += new
        return out
