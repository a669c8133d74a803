"""Attention-backend interface: the backend owns its metadata and its graph-time buffers."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from airserve.srt.forward_batch import ForwardBatch
from airserve.srt.mem_cache.memory_pool import DUMMY_PAGE, PagedAllocator


class AttentionBackend(ABC):
    """Computes attention over the paged KV cache and writes the new tokens' K/V.

    Graph runners call the three metadata hooks and never name a kernel:
    `init_forward_metadata` (eager), `init_forward_metadata_capture` and
    `init_forward_metadata_replay` (graph-time buffers sized by `init_graph_state`).
    """

    cpp_built = False  # decode runs airserve's C++ operator (torch_native on cpu, float32)

    def __init__(self, allocator: PagedAllocator, max_context_len: int) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        # Block tables always have this many columns, whatever the live context length.
        self.max_blocks = -(-max_context_len // self.page_size)
        self.graph_block_table: torch.Tensor | None = None

    # Eager.
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_decode():
            fb.attn_metadata = self.allocator.block_table(fb.req_pool_indices,
                                                          self.live_blocks(fb.seq_lens_cpu))
        else:
            fb.attn_metadata = None

    def live_blocks(self, seq_lens: list[int]) -> int:
        """Block table columns that rows of these lengths reach: the readers stop at a row's
        length, so an eager table needs no more (all max_blocks columns, 8192 at page size 1,
        cost ~0.7 ms at 64 rows)."""
        return max(1, -(-max(seq_lens, default=1) // self.page_size))

    # Graphs.
    def init_graph_state(self, max_bs: int) -> None:
        # [max_bs, max_blocks] int32, padded with the dummy page.
        self.graph_block_table = torch.full(
            (max_bs, self.max_blocks), DUMMY_PAGE, dtype=torch.int32,
            device=self.allocator.req_to_token.device,
        )

    def init_forward_metadata_capture(self, fb: ForwardBatch, bs: int) -> None:
        fb.attn_metadata = self.graph_block_table[:bs]

    def init_forward_metadata_replay(self, fb: ForwardBatch, bs: int, real_bs: int,
                                     req_pool_indices: torch.Tensor) -> None:
        """Fill the graph's block table for `real_bs` live rows; rows [real_bs, bs) point at the
        dummy page. `fb` is the graph's static batch; `req_pool_indices` the live requests."""
        table = self.graph_block_table
        # Only the columns the batch's longest row reaches (live_blocks): every reader stops at
        # a row's length (the C++ operator at each row's, the torch ops at the longest); a CUDA
        # graph reads every column under a mask, and older columns still hold page ids.
        live = self.live_blocks(fb.seq_lens_cpu[:real_bs])
        table[:real_bs, :live].copy_(self.allocator.block_table(req_pool_indices, live))
        table[real_bs:bs, :live].fill_(DUMMY_PAGE)
        fb.attn_metadata = table[:bs]

    # Compute.
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                scale: float, fb: ForwardBatch) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens. Returns [T, H, D]."""
        if fb.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer_id, scale, fb)
        return self.forward_extend(q, k, v, layer_id, scale, fb)

    @abstractmethod
    def forward_decode(self, q, k, v, layer_id: int, scale: float, fb: ForwardBatch):
        ...

    @abstractmethod
    def forward_extend(self, q, k, v, layer_id: int, scale: float, fb: ForwardBatch):
        ...
