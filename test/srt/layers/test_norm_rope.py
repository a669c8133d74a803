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
