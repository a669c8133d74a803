"""Paged attention on Ascend NPUs: FIA for decode, gather + SDPA for prefill.

Decode calls `torch_npu.npu_fused_infer_attention_score` (FIA) with the block table. Facts from
torch_npu's FIA reference (Ascend/pytorch docs, "torch_npu.npu_fused_infer_attention_score"),
page-attention case with one query token per request:
- `block_table` int32, 2-D: [B, >= blocks of the longest sequence]; our tables are always
  [B, ceil(context_len / page_size)].
- with query layout BSH or BSND the cache must be laid out (num_blocks, block_size, H) with
  H = kv_heads * head_dim, and `block_size` must be a multiple of 16 for fp16/bf16 and at most
  512 (128 recommended): checked at start-up (registry.PAGE_SIZE_LIMITS). The pool's
  [num_slots, kv_heads, head_dim] buffer, viewed as
  [num_pages, page_size, kv_heads * head_dim], is exactly that: a view, never a copy.
- `actual_seq_lengths_kv` is a host int list (schema `SymInt[]?`); the kernel's tiling reads it,
  which is why graph runners refresh it every step (padded rows: 1, reading the dummy page).
- query, key and value are float16 or bfloat16 only.
KV writes by slot use `torch_npu.npu_scatter_nd_update_`, the in-place scatter vllm-ascend's
torchair attention used to write its caches inside compiled graphs.

Prefill (any cached prefix) runs the torch_native backend's gather + SDPA per request, not FIA:
it is outside the decode graphs, and FIA's prefill page-attention constraints are unverified
here. That choice is logged once, at start-up.
"""

from __future__ import annotations

import logging

import torch

from airserve.srt.forward_batch import ForwardBatch
from airserve.srt.layers.attention.registry import check_page_size
from airserve.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from airserve.srt.mem_cache.memory_pool import PagedAllocator

logger = logging.getLogger(__name__)

FIA_DTYPES = (torch.float16, torch.bfloat16)


class NpuAttentionOps:
    """The two torch_npu kernels the backend uses, imported on first use."""

    def __init__(self) -> None:
        from airserve.srt.hardware import import_torch_npu

        self.torch_npu = import_torch_npu()

    def write_kv(self, cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
        """cache[slots[i]] = new[i]; cache [num_slots, KVH, D], slots [T] int64, new [T, KVH, D].
        ScatterNdUpdate with [T, 1] indices updates whole rows of dim 0."""
        self.torch_npu.npu_scatter_nd_update_(cache, slots.view(-1, 1), new.to(cache.dtype))

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_table: torch.Tensor, seq_lens: list[int], num_heads: int,
                         num_kv_heads: int, scale: float, block_size: int) -> torch.Tensor:
        """q [B, 1, H * D] (BSH); caches [num_blocks, block_size, KVH * D].
        Returns [B, 1, H * D]."""
        if q.dtype not in FIA_DTYPES:
            raise ValueError(f"FIA runs float16 or bfloat16, not {q.dtype}; start the server "
                             "with --dtype bfloat16 (or float16)")
        out, _ = self.torch_npu.npu_fused_infer_attention_score(
            q, k_cache, v_cache, block_table=block_table, actual_seq_lengths_kv=seq_lens,
            num_heads=num_heads, num_key_value_heads=num_kv_heads, scale=scale,
            input_layout="BSH", block_size=block_size,
        )
        return out


class AscendAttnBackend(TorchNativeAttnBackend):
    """FIA decode over the paged pool; prefill inherited from the torch_native backend.

    `ops` supplies `write_kv` and `decode_attention`; by default torch_npu's (NpuAttentionOps).
    Tests pass a CPU reference with the same signatures.
    """

    # The FIA argument graph runners must refresh on every replay (read by NPUGraphRunner).
    host_seq_lens_arg = "actual_seq_lengths_kv"

    def __init__(self, allocator: PagedAllocator, max_context_len: int, ops=None) -> None:
        super().__init__(allocator, max_context_len)
        check_page_size("ascend", self.page_size)
        self.ops = NpuAttentionOps() if ops is None else ops
        logger.info("ascend attention: decode with FIA (block size %d, block table width %d); "
                    "prefill with gather + SDPA", self.page_size, self.max_blocks)

    def forward_decode(self, q, k, v, layer_id: int, scale: float, fb: ForwardBatch):
        k_cache = fb.kv_cache.k_buffers[layer_id]
        v_cache = fb.kv_cache.v_buffers[layer_id]
        self.ops.write_kv(k_cache, fb.out_cache_loc, k)
        self.ops.write_kv(v_cache, fb.out_cache_loc, v)
        bs, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        pages = k_cache.shape[0] // self.page_size
        # Views of the pool in FIA's (num_blocks, block_size, H) layout: no copy.
        k_blocks = k_cache.view(pages, self.page_size, num_kv_heads * head_dim)
        v_blocks = v_cache.view(pages, self.page_size, num_kv_heads * head_dim)
        out = self.ops.decode_attention(
            q.reshape(bs, 1, num_heads * head_dim).to(k_cache.dtype), k_blocks, v_blocks,
            fb.attn_metadata, fb.seq_lens_cpu, num_heads, num_kv_heads, scale, self.page_size)
        return out.view(bs, num_heads, head_dim).to(q.dtype)
