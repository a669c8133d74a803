"""Rotary embedding: one table lookup per pass, each layer's rotation bit-identical to the
rotate_half formula (HF Llama) in float32, for Llama 3 scaled frequencies too."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.configs import ModelConfig
from airserve.srt.models.llama import RotaryEmbedding, apply_rotary, rope_inv_freq


def config(**overrides) -> ModelConfig:
    base = dict(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=256,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                max_position_embeddings=4096, tie_word_embeddings=True, attention_bias=False,
                qk_norm=False, eos_token_ids=(0,), bos_token_id=None, torch_dtype=None)
    return ModelConfig(**dict(base, **overrides))


def rotate_half_reference(x, cfg, positions):
    """x [T, H, D] rotated the textbook way: (x1 cos - x2 sin, x2 cos + x1 sin)."""
    freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32),
                        rope_inv_freq(cfg))
    cos, sin = freqs.cos()[positions, None], freqs.sin()[positions, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0,
                                            "original_max_position_embeddings": 1024}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_rotate_half_bit_for_bit(scaling, dtype):
    cfg = config(rope_scaling=scaling)
    rope = RotaryEmbedding(cfg, cfg.max_position_embeddings)
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, cfg.max_position_embeddings, (37,), generator=g)
    cos, sin = rope(positions)
    assert cos.shape == sin.shape == (37, 1, 64)
    for heads in (2, 1):  # q and k share the pass's tables
        x = torch.randn(37, heads, 64, generator=g).to(dtype)
        out = apply_rotary(x, cos, sin)
        assert out.dtype == dtype
        assert torch.equal(out, rotate_half_reference(x, cfg, positions))


def test_position_zero_is_identity_and_norm_is_kept():
    cfg = config()
    rope = RotaryEmbedding(cfg, 16)
    x = torch.randn(3, 2, 64)
    cos, sin = rope(torch.tensor([0, 5, 9]))
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[0], x[0])
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)


def test_tables_on_the_meta_device_are_shapes_only():
    """The loader builds the model under torch.device("meta") and rebuilds the tables on the
    real device: on meta they are empty tables of the real shapes, and building them imports
    no dynamo (torch's Python decompositions of meta arange did: ~2 s of an eager start-up).
    Checked in a fresh interpreter, where nothing else has imported dynamo yet."""
    import subprocess
    import sys

    cfg = config()
    with torch.device("meta"):
        meta = RotaryEmbedding(cfg, 256)
    real = RotaryEmbedding(cfg, 256)
    for name in ("cos", "sin"):
        assert getattr(meta, name).is_meta and getattr(real, name).device.type == "cpu"
        assert getattr(meta, name).shape == getattr(real, name).shape == (256, 64)
    code = (
        "import sys, torch\n"
        "from airserve.srt.configs import ModelConfig\n"
        "from airserve.srt.models.llama import LlamaForCausalLM\n"
        f"cfg = ModelConfig(**{cfg.__dict__!r})\n"
        "with torch.device('meta'):\n"
        "    LlamaForCausalLM(cfg, 256)\n"
        "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
