"""The static decode inputs every graph runner replays from, and which batches they can hold.

Buffers at fixed addresses sized for the largest bucket, bucket choice, the fallback rules, and
copying a live batch in with inert padded rows. Owned by `GraphRunner` (`self.inputs`).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from airserve.srt.forward_batch import ForwardBatch, ForwardMode, KVCache
from airserve.srt.mem_cache.memory_pool import DUMMY_SLOT

if TYPE_CHECKING:
    from airserve.srt.layers.attention.base import AttentionBackend


class StaticDecodeInputs:
    """Decode inputs for the largest bucket; the static batch of bucket bs holds views [:bs].

    Padded rows [real_bs, bucket) get token 0 at position 0, seq_len 1 (tensor and host list),
    the dummy KV slot as their write slot and, from the attention backend's replay hook, a block
    table of dummy pages: they read and write only the dummy page.
    """

    def __init__(self, buckets: list[int], padding: bool, device: torch.device | str,
                 kv_cache: KVCache, attn_backend: AttentionBackend,
                 kind: str = "captured") -> None:
        self.buckets = buckets  # sorted batch sizes
        self.max_bs = buckets[-1]
        self.padding = padding  # False: only batches of exactly a bucket's size replay
        self.kind = kind  # how the runner made its buckets, for fallback reasons
        self.attn_backend = attn_backend
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [max_bs]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [max_bs]
        self.req_pool_indices = torch.zeros(n, dtype=torch.int64, device=device)  # [max_bs]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [max_bs]
        self.out_cache_loc = torch.full((n,), DUMMY_SLOT, dtype=torch.int64, device=device)
        attn_backend.init_graph_state(n)
        self.batches = {bs: ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs],
            positions=self.positions[:bs], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], seq_lens_cpu=[1] * bs,
            out_cache_loc=self.out_cache_loc[:bs], kv_cache=kv_cache, attn_backend=attn_backend,
        ) for bs in buckets}

    def fallback_reason(self, fb: ForwardBatch) -> str | None:
        """None if a bucket can run `fb`, else why it must run eager."""
        if not fb.forward_mode.is_decode():
            return "not a decode batch"
        if fb.batch_size > self.max_bs:
            return f"batch size {fb.batch_size} > largest {self.kind} bucket {self.max_bs}"
        if not self.padding and fb.batch_size not in self.batches:
            return f"no bucket of exactly {fb.batch_size} (--disable-cuda-graph-padding)"
        return None

    def bucket_for(self, n: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def load(self, fb: ForwardBatch) -> ForwardBatch:
        """Copy the live decode batch `fb` into its bucket's static batch, pad it, return it."""
        n = fb.batch_size
        bs = self.bucket_for(n)
        # (buffer, live values, value of an inert padded row)
        for buf, live, inert in ((self.input_ids, fb.input_ids, 0),
                                 (self.positions, fb.positions, 0),
                                 (self.req_pool_indices, fb.req_pool_indices, 0),
                                 (self.seq_lens, fb.seq_lens, 1),
                                 (self.out_cache_loc, fb.out_cache_loc, DUMMY_SLOT)):
            buf[:n].copy_(live)
            buf[n:bs].fill_(inert)
        static = self.batches[bs]
        static.seq_lens_cpu = list(fb.seq_lens_cpu) + [1] * (bs - n)
        self.attn_backend.init_forward_metadata_replay(static, bs, n, fb.req_pool_indices)
        return static
