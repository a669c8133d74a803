"""The one batch type that crosses from the scheduler to the model runner."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from airserve.srt.layers.attention.base import AttentionBackend


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill of new tokens over any cached prefix
    DECODE = 2  # one new token per request

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND


@dataclass
class KVCache:
    """The per-layer KV tensors a forward pass reads and writes (graph inputs, never copied)."""

    k_buffers: list[torch.Tensor]  # each [num_slots, kv_heads, head_dim (int8: + 4, a scale)]
    v_buffers: list[torch.Tensor]
    page_size: int


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64, rows of ReqToTokenPool
    seq_lens: torch.Tensor  # [bs] int32, length of each sequence after this step
    seq_lens_cpu: list[int]  # the same on the host
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot each new token is written to
    kv_cache: KVCache
    # EXTEND only (host lists, one entry per request).
    extend_seq_lens_cpu: list[int] | None = None  # new tokens per request
    extend_prefix_lens_cpu: list[int] | None = None  # cached tokens per request
    last_token_indices: torch.Tensor | None = None  # [bs] int64 rows of the last new tokens
    return_all_logits: bool = False
    # EXTEND rows whose logits the forward returns, when some request needs more than its last
    # token's (prompt logprobs): [rows] int64 token rows, grouped by request in batch order,
    # each group ending with that request's last new token; `logit_counts_cpu` is the size of
    # each group. None: one row per request (`last_token_indices`).
    logit_rows: torch.Tensor | None = None
    logit_counts_cpu: list[int] | None = None
    # Set by the model runner and its attention backend before the forward pass.
    attn_backend: AttentionBackend | None = None
    attn_metadata: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
