"""The C++ prefill attention (`airserve::prefill_attention_cpu`, csrc/decode_attention.cpp)
against a float64 reference, on every instruction set this CPU offers: prompts of ragged
lengths in one call (lengths below, at and past the kernel's 64-token blocks), with and without
a cached prefix, GQA groups 1/3/4/8, head sizes 32/48/64/80/128 (80 and 48 leave AVX-512 for
AVX2's loops, 40 leaves AVX2 for plain C++), q/k/v as strided views of one fused projection (as
the model passes them), 1 and 2 threads; a token's output bit for bit the same whether its
prompt ran whole or in chunks; the attention backend's extend path, which calls it, against
torch's own SDPA path; and the operator's errors."""

from __future__ import annotations

import math

import pytest
import torch

from airserve.srt.layers import cpu_kernels
from airserve.srt.layers.attention import torch_native_backend as tnb

# float32 kernel vs float64 reference: outputs are softmax averages of N(0, 1) values.
ATOL = 2e-5

# (prompt lengths, KV heads, group, head dim, threads)
CASES = [
    ([128, 128, 128, 128], 3, 3, 64, 2),  # W2's prefill step: the default model's heads
    ([1, 7, 64, 65, 130], 3, 3, 64, 2),
    ([300], 2, 4, 128, 2),  # one long prompt: tasks of unequal work balanced
    ([33, 200], 1, 8, 32, 1),
    ([5, 70], 2, 1, 48, 2),
    ([100], 2, 3, 80, 1),
    ([17, 66], 1, 3, 40, 2),
]


def op():
    if not cpu_kernels.available():
        pytest.skip(f"C++ kernels not built: {cpu_kernels.unavailable_reason()}")
    return torch.ops.airserve.prefill_attention_cpu


def reference(q, k, v, starts, lens, scale, prefixes=None, k_starts=None):
    """float64 causal attention of each prompt's new tokens over its prefix and themselves;
    rows outside stay zero."""
    group = q.shape[1] // k.shape[1]
    prefixes = prefixes or [0] * len(lens)
    k_starts = starts if k_starts is None else k_starts
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s, ks0, p, n in zip(starts, k_starts, prefixes, lens):
        qs = q[s:s + n].double().transpose(0, 1)  # [H, n, D]
        ks = k[ks0:ks0 + p + n].double().repeat_interleave(group, 1).transpose(0, 1)
        vs = v[ks0:ks0 + p + n].double().repeat_interleave(group, 1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * scale
        hidden = torch.arange(p + n)[None, :] > torch.arange(n)[:, None] + p
        scores.masked_fill_(hidden, -math.inf)
        out[s:s + n] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


def run(out, q, k, v, starts, lens, scale, prefixes=None, k_starts=None):
    prefixes = prefixes or [0] * len(lens)
    op()(out, q, k, v, starts, starts if k_starts is None else k_starts, prefixes, lens, scale)


def fused_views(tokens, kv_heads, group, dim, seed):
    """q, k, v as views of one [T, (H + 2 KVH) D] projection: rows strided, heads contiguous."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    return q, k, v


@pytest.mark.parametrize("lens,kv_heads,group,dim,threads", CASES)
def test_matches_float64_reference(isa, lens, kv_heads, group, dim, threads):
    # A gap of two tokens before the last prompt: rows no prompt covers are left alone.
    starts, at = [], 0
    for i, n in enumerate(lens):
        at += 2 if i == len(lens) - 1 and i > 0 else 0
        starts.append(at)
        at += n
    q, k, v = fused_views(at, kv_heads, group, dim, seed=len(lens) * 100 + dim)
    out = torch.full(q.shape, 7.0)
    scale = dim ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run(out, q, k, v, starts, lens, scale)
    finally:
        torch.set_num_threads(before)
    ref = reference(q, k, v, starts, lens, scale)
    covered = torch.zeros(at, dtype=torch.bool)
    for s, n in zip(starts, lens):
        covered[s:s + n] = True
    assert (out[covered].double() - ref[covered]).abs().max().item() < ATOL
    assert (out[~covered] == 7.0).all()  # untouched


def test_extreme_scores_stay_finite(isa):
    """Scores of ~+-400 (rows whose maximum moves by hundreds between blocks): the online
    softmax must rescale without overflow."""
    q, k, v = fused_views(200, 3, 3, 64, seed=5)
    q = q * 50
    out = torch.empty(q.shape)
    run(out, q, k, v, [0], [200], 0.125)
    ref = reference(q, k, v, [0], [200], 0.125)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("prefixes,news", [([64, 100, 5], [64, 30, 130]), ([1, 127], [1, 2])])
def test_cached_prefix_matches_float64_reference(isa, prefixes, news):
    """New tokens after a cached prefix: keys are the prefix's then their own, gathered into
    one buffer (k_starts), queries elsewhere (q_starts)."""
    total = [p + n for p, n in zip(prefixes, news)]
    q_all, k, v = fused_views(sum(total), 3, 3, 64, seed=21)
    q = q_all[:sum(news)]
    q_starts = [sum(news[:i]) for i in range(len(news))]
    k_starts = [sum(total[:i]) for i in range(len(total))]
    out = torch.empty(q.shape)
    run(out, q, k, v, q_starts, news, 0.125, prefixes, k_starts)
    ref = reference(q, k, v, q_starts, news, 0.125, prefixes, k_starts)
    assert (out.double() - ref).abs().max().item() < ATOL


@pytest.mark.parametrize("cuts", [[7], [16], [100], [64, 129], [1, 2, 3]])
def test_chunked_prompt_equals_whole_bit_for_bit(isa, cuts):
    """A prompt prefilled in chunks (each chunk over the keys before it) gives every token
    the bits the whole prompt gave it: the property the prefix cache and chunked prefill
    rely on under --dtype float32 (issue: a cache hit must not change the output)."""
    n = 200
    q, k, v = fused_views(n, 3, 3, 64, seed=4)
    whole = torch.empty(q.shape)
    run(whole, q, k, v, [0], [n], 0.125)
    pieces = torch.empty(q.shape)
    bounds = [0, *cuts, n]
    for a, b in zip(bounds, bounds[1:]):
        part = torch.empty(b - a, 9, 64)
        run(part, q[a:b], k, v, [0], [b - a], 0.125, [a], [0])
        pieces[a:b] = part
    assert torch.equal(whole, pieces)


def test_backend_extend_matches_sdpa_path(monkeypatch):
    """forward_extend with the operator against the same batch through torch's SDPA path
    (cpp_built off for the fresh rows): fresh prompts of several lengths, float32 and float16
    caches (keys rounded as the cache holds them either way), and a q whose heads are not
    contiguous (the backend hands the operator a contiguous copy)."""
    op()
    from airserve.srt.forward_batch import ForwardBatch, ForwardMode

    lens = [9, 64, 100, 100]
    T = sum(lens)
    for kv_dtype, strided_q in ((torch.float32, False), (torch.float16, False),
                                (torch.float32, True)):
        q, k, v = fused_views(T, 3, 3, 64, seed=11)
        if strided_q:
            q = q.transpose(1, 2).contiguous().transpose(1, 2)  # strides (H*D, 1, H)
        k_cache = torch.zeros(T + 8, 3, 64, dtype=kv_dtype)
        v_cache = torch.zeros_like(k_cache)

        class Pool:
            k_buffers, v_buffers, page_size = [k_cache], [v_cache], 1

        fb = ForwardBatch.__new__(ForwardBatch)
        fb.forward_mode = ForwardMode.EXTEND
        fb.batch_size = len(lens)
        fb.extend_prefix_lens_cpu = [0] * len(lens)
        fb.extend_seq_lens_cpu = lens
        fb.out_cache_loc = torch.arange(1, T + 1)
        fb.kv_cache = Pool()
        backend = tnb.TorchNativeAttnBackend.__new__(tnb.TorchNativeAttnBackend)
        backend.init_forward_metadata(fb)
        backend.cpp_built = True
        got = backend.forward_extend(q, k, v, 0, 0.125, fb)
        backend.cpp_built = False
        want = backend.forward_extend(q, k, v, 0, 0.125, fb)
        assert (got - want).abs().max().item() < ATOL, kv_dtype


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v, o: (o, q.double(), k, v, [0], [0], [0], [4]), "float32"),
    (lambda q, k, v, o: (o, q, k[:, :2], v[:, :2], [0], [0], [0], [4]), "KVH dividing"),
    (lambda q, k, v, o: (o, q, k, v, [0], [0], [0], [9]), "do not fit q"),
    (lambda q, k, v, o: (o, q, k, v, [0], [0], [3], [6]), "do not fit k"),
    (lambda q, k, v, o: (o, q, k, v, [0, 1], [0], [0], [4]), "differ in length"),
    (lambda q, k, v, o: (o[:, :, ::2], q, k, v, [0], [0], [0], [4]), "contiguous"),
    (lambda q, k, v, o: (o, q.transpose(1, 2).contiguous().transpose(1, 2), k, v, [0], [0],
                         [0], [4]), "heads must be contiguous"),
])
def test_errors_name_the_problem(bad, match):
    q, k, v = fused_views(8, 3, 3, 64, seed=1)
    out = torch.empty(q.shape)
    args = bad(q, k, v, out)
    with pytest.raises(RuntimeError, match=match):
        op()(*args, 0.125)
