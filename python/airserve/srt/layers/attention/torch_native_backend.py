"""Paged attention in plain torch, for CPU (eager and inside compiled decode graphs).

Decode is one custom op: inside a compiled graph it is opaque, so the graph's shapes stay fixed
(block table padded to the maximum length) while the op reads only the live part of each block
table. Cost per step follows the live context, not the padded width nor the pool size.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

from airserve.srt.forward_batch import ForwardBatch
from airserve.srt.layers.attention.base import AttentionBackend
from airserve.srt.mem_cache.memory_pool import kv_rows, kv_values

# A plain Library op, not `torch.library.custom_op`: the latter's Python dispatch layers cost
# ~60 us a call here (measured, inference mode, 2 threads), once per layer per decode step.
_lib = torch.library.Library("airserve", "DEF")
_lib.define(
    "paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor out_cache_loc, Tensor block_table, Tensor seq_lens, "
    "int page_size, float scale) -> Tensor"
)


class _StaticWidth(threading.local):
    active = False


_static_width = _StaticWidth()


@contextlib.contextmanager
def static_decode_width():
    """Decode attention on CUDA reads every block-table column, as inside a CUDA graph: the
    graph runner's warm-up runs use it so that they run the captured shapes."""
    before, _static_width.active = _static_width.active, True
    try:
        yield
    finally:
        _static_width.active = before


def paged_decode_attention_kernel(
    q: torch.Tensor,  # [bs, H, D]
    k: torch.Tensor,  # [bs, KVH, D], the new token's key
    v: torch.Tensor,  # [bs, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D], written in place at out_cache_loc
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,  # [bs] int64
    block_table: torch.Tensor,  # [bs, max_blocks] int32
    seq_lens: torch.Tensor,  # [bs] int32, including the new token
    page_size: int,
    scale: float,
) -> torch.Tensor:
    k_cache.index_copy_(0, out_cache_loc, kv_rows(k, k_cache.dtype))
    v_cache.index_copy_(0, out_cache_loc, kv_rows(v, v_cache.dtype))
    bs, num_heads, head_dim = q.shape
    capturing = q.is_cuda and (_static_width.active or torch.cuda.is_current_stream_capturing())
    if capturing:
        # No host sync inside a CUDA graph: read every column (the mask hides the padding).
        # Warm-up runs before a capture take the same shapes (static_decode_width), so that
        # lazy set-up (cuDNN's attention plans and workspace) happens outside the graph:
        # cuDNN cannot allocate during a capture (CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_
        # FAILED at bs 64, bf16, H200).
        live = block_table.shape[1] * page_size
    else:
        live = int(seq_lens.max())
    # Few ops on purpose: this runs once per layer per decode step, and on CPU its cost is
    # per-op overhead (index_select is ~3x cheaper than advanced indexing here).
    slots = _live_slots(block_table, live, page_size).flatten()  # [bs * live]
    shape = (bs, live) + k_cache.shape[1:]
    # The cache's values in the queries' dtype: a bf16 cache under float32 queries (CPU)
    # attends in float32, as the C++ operator does.
    keys = kv_values(k_cache.index_select(0, slots).view(shape), q.dtype).transpose(1, 2)
    values = kv_values(v_cache.index_select(0, slots).view(shape), q.dtype).transpose(1, 2)
    mask = None
    if bs > 1 or capturing:  # else all `live` positions of the one row are its own
        positions = torch.arange(live, device=q.device)
        mask = (positions < seq_lens[:, None])[:, None, None, :]  # [bs, 1, 1, live]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale,
        enable_gqa=True)  # [bs, H, 1, D]
    return out.view(bs, num_heads, head_dim)


# Looked up at call time, so tests can wrap the kernel the compiled graphs call.
_lib.impl("paged_decode_attention",
          lambda *args: paged_decode_attention_kernel(*args), "CompositeExplicitAutograd")


@torch.library.register_fake("airserve::paged_decode_attention")
def _(q, k, v, k_cache, v_cache, out_cache_loc, block_table, seq_lens, page_size, scale):
    return torch.empty_like(q)


paged_decode_attention = torch.ops.airserve.paged_decode_attention.default

# The same step as one C++ operator (csrc/decode_attention.cpp, float32 only): a few
# microseconds a layer where the torch ops above cost ~150 us in per-op overhead on 2 cores;
# one pass over the K/V rows (online softmax), split over threads for long contexts.
_lib.define(
    "paged_decode_attention_cpu(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor out_cache_loc, Tensor block_table, Tensor seq_lens, "
    "int page_size, float scale) -> Tensor"
)


@torch.library.register_fake("airserve::paged_decode_attention_cpu")
def _(q, k, v, k_cache, v_cache, out_cache_loc, block_table, seq_lens, page_size, scale):
    return torch.empty_like(q)


# Prefill attention in one C++ operator (csrc/decode_attention.cpp, float32): sequence b's
# new tokens q[q_starts[b]:][:new_lens[b]], at positions prefix_lens[b] + j, attend causally over
# k/v[k_starts[b]:][:prefix_lens[b] + new_lens[b]] (its prefix's keys, then the new ones), into
# `out` in place. ~2x torch's flash kernel on W2's prefill shapes (2 threads, AVX-512), and a
# token's output does not depend on whether its prompt ran whole, in chunks or after a cache hit.
_lib.define(
    "prefill_attention_cpu(Tensor(a!) out, Tensor q, Tensor k, Tensor v, int[] q_starts, "
    "int[] k_starts, int[] prefix_lens, int[] new_lens, float scale) -> ()"
)


# Each head of K/V as an int8 cache holds it (csrc/decode_attention.cpp, quantize_head):
# [T, KVH, D] float32 -> [T, KVH, D + 4] int8, the values then their float32 scale.
_lib.define("quantize_kv_cpu(Tensor x) -> Tensor")


@torch.library.register_fake("airserve::quantize_kv_cpu")
def _(x):
    return x.new_empty(x.shape[:-1] + (x.shape[-1] + 4,), dtype=torch.int8)


# KV cache dtypes the C++ decode operator reads (its queries and arithmetic are float32).
CPP_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)


def cpp_decode_runs(device_type: str, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                    cpp_built: bool) -> bool:
    """Whether decode attention takes the C++ operator: built, on the host CPU, float32
    queries over a float32, bf16, f16 or int8 cache."""
    return (cpp_built and device_type == "cpu" and q_dtype == torch.float32
            and kv_dtype in CPP_KV_DTYPES)


def decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, cpp_built: bool):
    """The C++ operator where `cpp_decode_runs`, else the torch ops."""
    if cpp_decode_runs(q.device.type, q.dtype, k_cache.dtype, cpp_built):
        return torch.ops.airserve.paged_decode_attention_cpu.default
    return paged_decode_attention


def attention_isas() -> list[str]:
    """Instruction sets the C++ decode attention can use on this CPU, best first ("avx512",
    "avx2", "scalar"); the first is used unless `use_attention_isa` narrowed it."""
    return list(torch.ops.airserve_isa.attention_isas())


def attention_isa() -> str:
    """The instruction set the C++ decode attention uses now (for head sizes its vector lanes
    divide; the operator steps down to a narrower one, or plain C++, for others)."""
    return str(torch.ops.airserve_isa.attention_isa())


def use_attention_isa(name: str) -> str:
    """Make the C++ decode attention use `name` ("auto": the best this CPU has); tests and
    benchmarks use it to run every path. Raises RuntimeError for one the CPU lacks."""
    return str(torch.ops.airserve_isa.set_attention_isa(name))


def _live_slots(block_table: torch.Tensor, live: int, page_size: int) -> torch.Tensor:
    """KV slots of the first `live` positions of every row: [bs, live] int64."""
    if page_size == 1:
        return block_table[:, :live].to(torch.int64)
    blocks = -(-live // page_size)
    offsets = torch.arange(page_size, device=block_table.device)
    slots = block_table[:, :blocks, None].to(torch.int64) * page_size + offsets
    return slots.flatten(1)[:, :live]


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, allocator, max_context_len: int) -> None:
        super().__init__(allocator, max_context_len)
        from airserve.srt.layers import cpu_kernels

        # Built (or found unbuildable) here, not on the first decode step, which may be inside
        # a torch.compile trace that cannot run the build.
        self.cpp_built = allocator.req_to_token.device.type == "cpu" and cpu_kernels.available()

    def forward_decode(self, q, k, v, layer_id: int, scale: float, fb: ForwardBatch):
        cache = fb.kv_cache
        op = decode_attention_op(q, cache.k_buffers[layer_id], self.cpp_built)
        return op(
            q, k, v, cache.k_buffers[layer_id], cache.v_buffers[layer_id], fb.out_cache_loc,
            fb.attn_metadata, fb.seq_lens, cache.page_size, scale,
        )

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_decode():
            super().init_forward_metadata(fb)
            return
        fb.attn_metadata = self.extend_plan(fb)

    def extend_plan(self, fb: ForwardBatch) -> ExtendPlan:
        """The extend batch's row layout, which every layer shares (made once per forward)."""
        news, prefixes = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        plan = ExtendPlan(starts=_row_starts(news))
        for i in range(fb.batch_size):
            if prefixes[i] == 0:
                plan.fresh.setdefault(news[i], []).append(i)
            elif news[i] == 1:
                plan.one_token.append(i)
            else:
                plan.prefixed.append(i)
        if plan.prefixed:
            slots, total = [], 0
            for i in plan.prefixed:
                n = prefixes[i] + news[i]
                slots.append(self.allocator.req_to_token[fb.req_pool_indices[i], :n])
                plan.prefixed_k_starts.append(total)
                total += n
            plan.prefixed_slots = torch.cat(slots).to(torch.int64)
        if plan.one_token:
            device = fb.out_cache_loc.device
            plan.one_token_at = torch.tensor([plan.starts[i] for i in plan.one_token],
                                             dtype=torch.int64, device=device)
            rows = torch.tensor(plan.one_token, dtype=torch.int64, device=device)
            width = self.live_blocks([fb.seq_lens_cpu[i] for i in plan.one_token])
            plan.one_token_table = self.allocator.block_table(fb.req_pool_indices[rows], width)
            plan.one_token_seq_lens = fb.seq_lens[rows]
        return plan

    def forward_extend(self, q, k, v, layer_id: int, scale: float, fb: ForwardBatch):
        plan: ExtendPlan = fb.attn_metadata
        k_cache = fb.kv_cache.k_buffers[layer_id]
        v_cache = fb.kv_cache.v_buffers[layer_id]
        # As the cache holds them (an int8 cache: values and scales).
        k_kept, v_kept = kv_rows(k, k_cache.dtype), kv_rows(v, v_cache.dtype)
        k_cache.index_copy_(0, fb.out_cache_loc, k_kept)
        v_cache.index_copy_(0, fb.out_cache_loc, v_kept)
        out = q.new_empty(q.shape)  # contiguous whatever q's strides
        if self.cpp_built and q.device.type == "cpu" and q.dtype == torch.float32:
            self._cpp_prefill(q, k_kept, k_cache, v_kept, v_cache, out, fb, plan, scale)
        else:
            for j, i in enumerate(plan.prefixed):
                self._extend_row(q, k_cache, v_cache, out, fb, plan, j, i, scale)
            # Rows without a cached prefix see only their own new tokens: the ones of equal
            # length run as one causal product over k and v as given (no gather from the cache).
            for new, rows in plan.fresh.items():
                _causal_rows(q, k_kept, v_kept, out, [plan.starts[i] for i in rows], new, scale)
        if plan.one_token:
            self._one_token_rows(q, k, v, k_cache, v_cache, out, plan, scale, fb)
        return out

    def _cpp_prefill(self, q, k_kept, k_cache, v_kept, v_cache, out, fb: ForwardBatch,
                     plan: ExtendPlan, scale: float) -> None:
        """The fresh rows over the step's own k/v as the cache holds them (`k_kept`,
        `v_kept`), the rows with a cached prefix over their keys gathered from the cache: one
        operator call each."""
        op = torch.ops.airserve.prefill_attention_cpu
        news, prefixes = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        q = _heads_contiguous(q)
        fresh = [i for rows in plan.fresh.values() for i in rows]
        if fresh:
            # No copy for a float32 cache.
            keys = _heads_contiguous(kv_values(k_kept, q.dtype))
            values = _heads_contiguous(kv_values(v_kept, q.dtype))
            at = [plan.starts[i] for i in fresh]
            op(out, q, keys, values, at, at, [0] * len(fresh), [news[i] for i in fresh], scale)
        if plan.prefixed:
            rows = plan.prefixed
            op(out, q, kv_values(k_cache.index_select(0, plan.prefixed_slots), q.dtype),
               kv_values(v_cache.index_select(0, plan.prefixed_slots), q.dtype),
               [plan.starts[i] for i in rows], plan.prefixed_k_starts,
               [prefixes[i] for i in rows], [news[i] for i in rows], scale)

    def _extend_row(self, q, k_cache, v_cache, out, fb: ForwardBatch, plan: ExtendPlan, j: int,
                    i: int, scale: float) -> None:
        """Row i (the plan's j-th prefixed row): its new tokens over its cached prefix and
        themselves (keys from the cache)."""
        prefix = fb.extend_prefix_lens_cpu[i]
        new = fb.extend_seq_lens_cpu[i]
        total = prefix + new
        start, first = plan.starts[i], plan.prefixed_k_starts[j]
        slots = plan.prefixed_slots[first:first + total]
        # [1, KVH, total, D], in the queries' dtype (a bf16 cache attends in float32 on CPU)
        keys = kv_values(k_cache.index_select(0, slots), q.dtype).transpose(0, 1).unsqueeze(0)
        values = kv_values(v_cache.index_select(0, slots), q.dtype).transpose(0, 1).unsqueeze(0)
        query = q[start:start + new].transpose(0, 1).unsqueeze(0)  # [1, H, new, D]
        # Query j sits at absolute position prefix + j and sees keys 0..prefix + j.
        rows = torch.arange(new, device=q.device)[:, None] + prefix
        mask = torch.arange(total, device=q.device)[None, :] <= rows
        o = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + new] = o[0].transpose(0, 1)

    def _one_token_rows(self, q, k, v, k_cache, v_cache, out, plan: ExtendPlan, scale: float,
                        fb: ForwardBatch) -> None:
        """The rows of an extend batch that add one token after a cached prefix (the decode
        rows of a mixed batch) attend in one decode call, as in a decode step, not one
        gather + attention per row."""
        tokens = plan.one_token_at
        op = decode_attention_op(q, k_cache, self.cpp_built)
        o = op(q[tokens], k[tokens], v[tokens], k_cache, v_cache, fb.out_cache_loc[tokens],
               plan.one_token_table, plan.one_token_seq_lens, fb.kv_cache.page_size, scale)
        out.index_copy_(0, tokens, o.to(out.dtype))


@dataclass
class ExtendPlan:
    """What every layer of one extend batch shares, made once per forward by
    `TorchNativeAttnBackend.init_forward_metadata` (it was rebuilt in each layer): the rows by
    kind, the prefixed rows' KV slots, the one-token rows' block table."""

    starts: list[int]  # each row's first token in q/k/v/out
    fresh: dict[int, list[int]] = field(default_factory=dict)  # no cached prefix, by length
    prefixed: list[int] = field(default_factory=list)  # several new tokens after a prefix
    # The prefixed rows' KV slots of positions 0..prefix + new, one row after another, and
    # where each row's begin.
    prefixed_slots: torch.Tensor | None = None
    prefixed_k_starts: list[int] = field(default_factory=list)
    one_token: list[int] = field(default_factory=list)  # one new token after a prefix
    one_token_at: torch.Tensor | None = None  # their tokens in q/k/v/out
    one_token_table: torch.Tensor | None = None  # their block table, as wide as they reach
    one_token_seq_lens: torch.Tensor | None = None


def _heads_contiguous(t: torch.Tensor) -> torch.Tensor:
    """[T, heads, D] with each token's heads contiguous (any token stride), as the prefill
    operator reads them: the model's q/k/v views of a fused projection already are."""
    if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]:
        return t
    return t.contiguous()


def _row_starts(lens: list[int]) -> list[int]:
    starts, total = [], 0
    for n in lens:
        starts.append(total)
        total += n
    return starts


def _causal_rows(q, k_kept, v_kept, out, starts: list[int], new: int, scale: float) -> None:
    """Causal attention of rows of `new` tokens each (token offsets `starts` in q and in the
    step's K/V as the cache holds them) over their own tokens only, as one batched product;
    written into `out`."""
    def gather(t: torch.Tensor) -> torch.Tensor:  # [T, heads, D] -> [rows, heads, new, D]
        if len(starts) == 1:
            part = t[starts[0]:starts[0] + new].unsqueeze(0)
        elif starts == [starts[0] + j * new for j in range(len(starts))]:  # adjacent rows
            part = t[starts[0]:starts[0] + len(starts) * new].unflatten(0, (len(starts), new))
        else:
            part = torch.stack([t[s:s + new] for s in starts])
        return part.transpose(1, 2)

    # The keys as the cache holds them (rounded to its dtype), as the gathered path reads them,
    # in the queries' dtype.
    keys = gather(kv_values(k_kept, q.dtype))
    values = gather(kv_values(v_kept, q.dtype))
    o = torch.nn.functional.scaled_dot_product_attention(
        gather(q), keys, values, is_causal=True, scale=scale, enable_gqa=True)
    o = o.transpose(1, 2)  # [rows, new, H, D]
    if len(starts) > 1 and starts != [starts[0] + j * new for j in range(len(starts))]:
        for j, s in enumerate(starts):
            out[s:s + new] = o[j]
    else:
        out[starts[0]:starts[0] + len(starts) * new] = o.flatten(0, 1)
