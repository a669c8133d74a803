"""A CPU stand-in for the two torch_npu kernels the ascend attention backend calls.

`fia_decode` follows torch_npu's documented `npu_fused_infer_attention_score` semantics for
one query token per request with page attention: query BSH [B, 1, H * D], caches
[num_blocks, block_size, KVH * D], block_table int32 [B, >= blocks], and a host list
`actual_seq_lengths_kv` (schema `SymInt[]`, as torch_npu's) of how many cached tokens each row
attends to. Registered as a custom op so it stays one opaque node in a compiled graph, with the
host list as symbolic-int inputs, exactly where FIA sits on an NPU.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("airserve_test::fia_decode", mutates_args=())
def fia_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: list[int], num_heads: int,
               num_kv_heads: int, scale: float, block_size: int) -> torch.Tensor:
    bsz = q.shape[0]
    head_dim = q.shape[2] // num_heads
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    for b in range(bsz):
        n = seq_lens[b]
        blocks = block_table[b, : -(-n // block_size)].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()
        keys = keys.repeat_interleave(group, dim=1)  # [n, H, D]
        values = values.repeat_interleave(group, dim=1)
        query = q[b, 0].view(num_heads, head_dim).float()
        probs = (torch.einsum("hd,nhd->hn", query, keys) * scale).softmax(-1)
        out[b, 0] = torch.einsum("hn,nhd->hd", probs, values).reshape(-1).to(q.dtype)
    return out


@fia_decode.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, num_heads, num_kv_heads, scale, block_size):
    return torch.empty_like(q)


class ReferenceAttentionOps:
    """Same signatures as airserve's NpuAttentionOps, on CPU."""

    def write_kv(self, cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
        cache.index_copy_(0, slots, new.to(cache.dtype))

    def decode_attention(self, q, k_cache, v_cache, block_table, seq_lens, num_heads,
                         num_kv_heads, scale, block_size):
        return fia_decode(q, k_cache, v_cache, block_table, seq_lens, num_heads, num_kv_heads,
                          scale, block_size)
