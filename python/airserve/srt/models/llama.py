"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in plain torch over a paged KV cache."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from airserve.srt.configs import ModelConfig
from airserve.srt.layers.linear import Linear

if TYPE_CHECKING:
    from airserve.srt.forward_batch import ForwardBatch
    from airserve.srt.layers.quant.block_matvec import PackedWeight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        # Llama 3.1 frequency-dependent scaling (values from the model's rope_scaling).
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind not in ("default", None):
        raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(cfg))
        # [max_positions, head_dim // 2] each; not saved with the weights.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: [T, H, D], k: [T, KVH, D]; rotate_half convention (HF Llama).
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        h, d = cfg.hidden_size, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=False)
        # One product for q, k and v when set (OpenVINO graphs: see with_openvino_linears).
        self.qkv_proj: nn.Module | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                fb: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            kv = self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split((self.num_heads * self.head_dim, kv, kv), dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        out = fb.attn_backend.forward(q, k, v, self.layer_id, self.scale, fb)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # like Attention.qkv_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rope, fb):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, fb)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg, max_positions)

    def forward(self, input_ids, positions, fb):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rotary_emb, fb)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns float32 logits [rows, vocab], one row per
        sequence (its last token) unless `fb.return_all_logits`, then one row per token, or
        `fb.logit_rows` when set (the rows prompt logprobs need)."""
        hidden = self.model(input_ids, positions, fb)
        if fb.logit_rows is not None:
            hidden = hidden[fb.logit_rows]
        elif fb.last_token_indices is not None and not fb.return_all_logits:
            hidden = hidden[fb.last_token_indices]
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy named tensors (HF naming) into the parameters; missing or unknown names raise."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in the model")
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            loaded.add(name)
        expected = {n for n in params if not (n == "lm_head.weight" and
                                              self.config.tie_word_embeddings)}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")

    def attach_packed_weights(self, weights: Iterable[tuple[str, PackedWeight]],
                              max_rows: int, activations: str = "float32",
                              drop_weights: bool = False) -> dict[str, int]:
        """Give linear layers the block-quantized copies of their weights (HF names) for
        inputs of <= max_rows rows, products with `activations` ("float32" or "int8").
        `drop_weights` frees the float weights of those layers (not a weight shared with the
        embedding). Returns {kind: layers} for the report."""
        modules = dict(self.named_modules())
        kinds: dict[str, int] = {}
        for name, packed in weights:
            tied = name == "model.embed_tokens.weight" and self.config.tie_word_embeddings
            if tied:
                name = "lm_head.weight"
            layer = modules.get(name.removesuffix(".weight"))
            if not isinstance(layer, Linear):
                continue  # e.g. an untied embedding: its lookup reads one row
            layer.attach_packed(packed, max_rows, activations, drop_weights and not tied)
            kinds[packed.kind] = kinds.get(packed.kind, 0) + 1
        return kinds

    def decode_weight_bytes(self, batch_size: int) -> int:
        """Bytes of weights a decode step of `batch_size` rows reads (not the embedding table,
        of which it reads one row per sequence)."""
        total = 0
        for module in self.modules():
            if isinstance(module, Linear):
                total += module.weight_bytes(batch_size)
                if module.bias is not None:
                    total += module.bias.numel() * module.bias.element_size()
            elif isinstance(module, RMSNorm):
                total += sum(p.numel() * p.element_size() for p in module.parameters())
        return total
