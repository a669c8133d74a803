"""RMSNorm and the rotary embedding in C++ (layers/norm_rope.py, csrc/norm_rope.cpp) for eager
float32 passes: the vector and plain loops against models/llama's torch arithmetic (the rotation
bit for bit, the norm within a few float32 ulps: only its sum of squares is added in another
order) and a float64 reference; odd widths and strided inputs; errors; and the model's layers
taking them only where they apply."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.layers import cpu_kernels, norm_rope


def kernels():
    if not cpu_kernels.available():
        pytest.skip(f"C++ kernels not built: {cpu_kernels.unavailable_reason()}")


def torch_rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def torch_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin


@pytest.mark.parametrize("tokens,dim,threads", [(1, 576, 1), (512, 576, 2), (7, 64, 2),
                                                (3, 20, 1), (5, 13, 1)])
def test_rms_norm(tokens, dim, threads):
    kernels()
    torch.manual_seed(tokens + dim)
    x = torch.randn(tokens, dim) * 3
    w = torch.randn(dim)
    eps = 1e-5
    want64 = w.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + eps).sqrt()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for op in (torch.ops.airserve.rms_norm, torch.ops.airserve.rms_norm_portable):
            out = op(x, w, eps)
            torch.testing.assert_close(out, torch_rms(x, w, eps), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(out.double(), want64, rtol=1e-6, atol=1e-6)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("tokens,heads,dim", [(512, 9, 64), (3, 2, 128), (4, 3, 20), (2, 1, 6)])
def test_rotary_bit_exact(tokens, heads, dim):
    kernels()
    torch.manual_seed(heads * dim)
    qkv = torch.randn(tokens, heads + 4, dim)
    x = qkv[:, 1:heads + 1]  # a strided view, as q out of the merged q/k/v product
    angles = torch.rand(tokens, 1, dim // 2) * 50
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((-angles.sin(), angles.sin()), -1)
    want = torch_rotary(x, cos, sin)
    for op in (torch.ops.airserve.rotary, torch.ops.airserve.rotary_portable):
        out = op(x, cos.squeeze(1), sin.squeeze(1))
        assert out.is_contiguous() and out.shape == x.shape
        assert torch.equal(out, want)
    assert torch.equal(norm_rope.rotary(x, cos, sin), want)


def test_errors():
    kernels()
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.airserve.rms_norm(torch.randn(2, 8).double(), torch.randn(8), 1e-6)
    with pytest.raises(RuntimeError, match=r"weight must be float32 \[8\]"):
        torch.ops.airserve.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="even dim"):
        torch.ops.airserve.rotary(torch.randn(2, 1, 5), torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.airserve.rotary(torch.randn(2, 1, 4), torch.randn(3, 4), torch.randn(2, 4))


def test_model_layers_use_them_in_eager_float32_only():
    """The model's RMSNorm and apply_rotary take the operators for eager float32 CPU input (and
    compute what their torch ops compute) and not for other dtypes."""
    kernels()
    from airserve.srt.models.llama import RMSNorm, apply_rotary

    assert norm_rope.fused_eager(torch.randn(2, 4))
    assert not norm_rope.fused_eager(torch.randn(2, 4).bfloat16())
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(10, 3, 64)
    torch.testing.assert_close(norm(x), torch_rms(x, norm.weight, 1e-6), rtol=1e-6, atol=1e-6)
    xb = x.bfloat16()  # the torch ops: float32 arithmetic, rounded to bf16 before the weight
    xf = xb.float()
    assert torch.equal(norm(xb), norm.weight * (xf * torch.rsqrt(
        xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16())
    angles = torch.rand(10, 1, 32)
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((-angles.sin(), angles.sin()), -1)
    assert torch.equal(apply_rotary(x, cos, sin), torch_rotary(x, cos, sin))
    assert apply_rotary(xb, cos, sin).dtype == torch.bfloat16


@pytest.mark.parametrize("tokens,dim,threads", [(1, 576, 1), (512, 576, 2), (7, 64, 2),
                                                (5, 13, 1)])
def test_rms_norm_bf16_is_the_float32_norm_rounded(tokens, dim, threads):
    """rms_norm_bf16 gives rms_norm's output rounded by torch's bf16 rounding, bit for bit."""
    kernels()
    torch.manual_seed(tokens * dim)
    x = torch.randn(tokens, dim) * 3
    w = torch.randn(dim)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = norm_rope.rms_norm_bf16(x, w, 1e-5)
    finally:
        torch.set_num_threads(saved)
    want = torch.ops.airserve.rms_norm(x, w, 1e-5).bfloat16()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    with pytest.raises(RuntimeError, match="x must be float32"):
        norm_rope.rms_norm_bf16(x.bfloat16(), w, 1e-5)
    with pytest.raises(RuntimeError, match=rf"weight must be float32 \[{dim}\]"):
        norm_rope.rms_norm_bf16(x, w[:-1], 1e-5)


def test_norm_for_a_product_is_bf16_only_where_the_product_reads_bf16():
    """RMSNorm.for_product rounds its output to bf16 for a consumer that multiplies these rows
    by the bfloat16 path without residual channels, and keeps float32 for one with residual
    channels (their float32 error is added back) or on the float32 path."""
    kernels()
    from airserve.srt.layers.linear import Linear
    from airserve.srt.models.llama import RMSNorm

    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(12, 64)
    plain, residual, float32 = Linear(64, 32), Linear(64, 32), Linear(64, 32)
    plain.set_large_path("bfloat16")
    residual.set_large_path("bfloat16", outliers=torch.tensor([1, 7]))
    h = norm.for_product(x, plain, decode=False)
    assert h.dtype == torch.bfloat16 and torch.equal(h.float(), norm(x).bfloat16().float())
    assert torch.equal(plain(h), plain(norm(x)))  # what the product computes is unchanged
    for consumer in (residual, float32):
        h = norm.for_product(x, consumer, decode=False)
        assert h.dtype == torch.float32 and torch.equal(h, norm(x))


def test_bf16_model_passes_give_the_float32_routes_bits(tiny_llama_dir, monkeypatch):
    """A model on the bfloat16 path, prompts prefilled and decoded eagerly: greedy tokens and
    their logprobs are the same with the norms and the MLP handing their products bf16
    (RMSNorm.for_product, silu_and_mul_product) as with every product casting float32 itself."""
    kernels()
    from airserve import Engine
    from airserve.srt.hardware import host_cpu
    from airserve.srt.layers.quant import matmul_paths
    from airserve.srt.models import llama

    if not matmul_paths.cpu_has_bf16(host_cpu()[1]):
        pytest.skip("this CPU has no bf16 dot products: --dtype bfloat16 is refused here")
    prompts = [[5, 9, 2, 40, 17, 3, 8, 11] * 3, [7, 1, 30, 2, 6]]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}

    def run():
        eng = Engine(model_path=tiny_llama_dir, dtype="bfloat16", max_total_tokens=2048,
                     max_running_requests=4, num_threads=2, packed_decode_max_bs=0)
        try:
            out = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        finally:
            eng.shutdown()
        return [[tuple(t[:2]) for t in o["meta_info"]["output_token_logprobs"]] for o in out]

    seen = []
    real_norm = llama.norm_rope.rms_norm_bf16
    monkeypatch.setattr(llama.norm_rope, "rms_norm_bf16",
                        lambda *a: seen.append(1) or real_norm(*a))
    fused = run()
    assert seen, "the norms never handed a product bf16"
    monkeypatch.setattr(llama.RMSNorm, "for_product", lambda self, x, consumer, decode: self(x))
    monkeypatch.setattr(llama, "silu_and_mul_product", lambda *a: None)
    assert run() == fused
