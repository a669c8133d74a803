"""The C++ paged decode attention (csrc/decode_attention.cpp) against a float64 reference, on
every instruction set this CPU offers: random batches and ragged lengths (lengths not multiples
of the kernel's 4-token blocks or 64-token chunks), GQA group sizes 1/3/4/5/8 (query heads in
blocks of up to three), head sizes 32/48/64/128 (and 40, which the AVX-512 loops leave to
AVX2's, and AVX2's to plain C++), pages of 1 and 16 with shuffled block tables, 1 and 2 threads
(long rows are split over the threads and merged); float32 and bfloat16 caches (bf16 rows
widened to float32 as read: the reference reads the same rounded values), float16 caches
(the same, converted) and int8 caches (each head row's int8 values times its scale: the
reference reads the same dequantized values, and the new rows are written as `kv_rows`
quantizes them)."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.layers import cpu_kernels
from airserve.srt.layers.attention import torch_native_backend as tnb
from airserve.srt.mem_cache.memory_pool import kv_rows, kv_values

# float32 kernel vs float64 reference: outputs are softmax averages of N(0, 1) values, so an
# absolute bound; the kernel's own error measured here is ~5e-7.
ATOL = 1e-5

# (batch size, longest row, KV heads, group, head dim, page size, threads)
CASES = [
    (1, 2100, 3, 3, 64, 1, 2),  # the default model's heads, one long row split over threads
    (1, 2047, 2, 4, 128, 16, 2),
    (70, 300, 2, 1, 128, 16, 1),
    (64, 260, 3, 3, 64, 1, 2),  # many ragged rows balanced over threads, a row cut in two
    (5, 1030, 1, 3, 64, 16, 2),
    (9, 77, 2, 4, 40, 1, 2),
    (3, 9, 3, 1, 64, 1, 1),
    (4, 150, 2, 5, 48, 1, 2),  # a group of 5 (query heads in blocks of 3 + 2); 48 = 3 x 16
    (2, 70, 1, 8, 32, 16, 1),  # a group of 8: blocks of 3 + 3 + 2
]


def op():
    if not cpu_kernels.available():
        pytest.skip(f"C++ kernels not built: {cpu_kernels.unavailable_reason()}")
    return torch.ops.airserve.paged_decode_attention_cpu.default


def make_case(bs, max_len, kv_heads, group, dim, page_size, seed, kv_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (bs,), generator=g, dtype=torch.int32)
    lens[0] = max_len
    width = -(-max_len // page_size) + 1  # one padding block past the longest row
    pages = bs * width + 2
    k_cache = kv_rows(torch.randn(pages * page_size, kv_heads, dim, generator=g), kv_dtype)
    v_cache = kv_rows(torch.randn(pages * page_size, kv_heads, dim, generator=g), kv_dtype)
    # Shuffled distinct pages (never page 0); the padding past each row is page 0.
    table = (torch.randperm(pages - 1, generator=g)[:bs * width] + 1).to(torch.int32)
    table = table.view(bs, width)
    for b in range(bs):
        table[b, -(-int(lens[b]) // page_size):] = 0
    pos = (lens - 1).long()
    loc = table[torch.arange(bs), pos // page_size].long() * page_size + pos % page_size
    q = torch.randn(bs, kv_heads * group, dim, generator=g)
    k = torch.randn(bs, kv_heads, dim, generator=g)
    v = torch.randn(bs, kv_heads, dim, generator=g)
    return q, k, v, k_cache, v_cache, loc, table, lens


def reference(q, k_cache, v_cache, table, lens, page_size, scale):
    """Attention of each row over its first lens[b] positions, in float64: [bs, H, D]."""
    group = q.shape[1] // k_cache.shape[1]
    outs = []
    for b in range(q.shape[0]):
        pos = torch.arange(int(lens[b]))
        slots = table[b, pos // page_size].long() * page_size + pos % page_size
        # [n, H, D]: the values the cache holds (an int8 row's values times its scale)
        keys = kv_values(k_cache[slots], torch.float64).repeat_interleave(group, dim=1)
        values = kv_values(v_cache[slots], torch.float64).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), keys) * scale
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
    return torch.stack(outs)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8],
                         ids=["f32", "bf16", "f16", "int8"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "bs{}-L{}-kvh{}-g{}-d{}-p{}-t{}".format(*c))
def test_matches_float64_reference_and_writes_only_out_cache_loc(isa, case, kv_dtype):
    bs, max_len, kv_heads, group, dim, page_size, threads = case
    q, k, v, k_cache, v_cache, loc, table, lens = make_case(
        bs, max_len, kv_heads, group, dim, page_size, seed=sum(case), kv_dtype=kv_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    # Written as torch converts (bf16: round to nearest even), int8 as kv_rows quantizes.
    expected_k[loc], expected_v[loc] = kv_rows(k, kv_dtype), kv_rows(v, kv_dtype)
    scale = dim ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = op()(q, k, v, k_cache, v_cache, loc, table, lens, page_size, scale)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    expected = reference(q, k_cache, v_cache, table, lens, page_size, scale)
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0)


def test_threads_split_long_rows_to_the_same_result(isa):
    """A long row split over 2 threads (then merged) equals the 1-thread pass."""
    args = make_case(1, 2100, 3, 3, 64, 1, seed=7)
    outs = []
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            outs.append(op()(*[a.clone() for a in args], 1, 0.125))
        finally:
            torch.set_num_threads(before)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=0)


def test_rejects_unknown_isa_and_pages_outside_the_pool():
    o = op()
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        tnb.use_attention_isa("sse9")
    q, k, v, k_cache, v_cache, loc, table, lens = make_case(1, 8, 1, 1, 64, 1, seed=0)
    table[0, 2] = k_cache.shape[0]  # a page past the pool's end
    with pytest.raises(RuntimeError, match="is not a page"):
        o(q, k, v, k_cache, v_cache, loc, table, lens, 1, 0.125)
