"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in plain torch over a paged KV cache."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from airserve.srt.configs import ModelConfig
from airserve.srt.distributed.parallel_state import SINGLE, TPGroup
from airserve.srt.distributed.sharding import column_shard, qkv_shards, vocab_shard
from airserve.srt.layers import cpu_kernels, norm_rope
from airserve.srt.layers.activation import silu_and_mul, silu_and_mul_product
from airserve.srt.layers.embedding import VocabParallelEmbedding
from airserve.srt.layers.linear import Linear
from airserve.srt.layers.parallel_linear import ColumnLinear, RowLinear

if TYPE_CHECKING:
    from airserve.srt.forward_batch import ForwardBatch
    from airserve.srt.layers.quant.block_matvec import PackedWeight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float32 and norm_rope.fused_eager(x):
            return norm_rope.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def for_product(self, x: torch.Tensor, consumer: Linear, decode: bool) -> torch.Tensor:
        """The norm of x [T, D] as `consumer` multiplies it: rounded to bf16 in the same pass
        where the consumer takes these rows by the bfloat16 path in C++ without residual
        channels (the bits it would cast the float32 norm to: one pass over the activations
        fewer each way), else `forward(x)`."""
        if (self.weight.dtype == torch.float32 and x.dim() == 2 and norm_rope.fused_eager(x)
                and consumer.takes_bf16_input(x.shape[0], decode)
                and consumer.weight_bf16.channels is None):
            return norm_rope.rms_norm_bf16(x, self.weight, self.eps)
        return self(x)


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
    """Rotary position tables; `forward(positions)` looks them up once per model pass for
    every layer, `apply_rotary` rotates each layer's q and k with them."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        if torch.empty(0).is_meta:
            # Built under torch.device("meta") (the loader), which rebuilds the tables on the real
            # device: shapes only. Computing them on meta runs torch's Python decompositions,
            # whose first use imports dynamo (~2 s of an eager server's start-up).
            shape = (max_positions, cfg.head_dim)
            self.register_buffer("cos", torch.empty(shape), persistent=False)
            self.register_buffer("sin", torch.empty(shape), persistent=False)
            return
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(cfg))
        # [max_positions, head_dim] each, not saved with the weights: cos twice, and sin with
        # the sign the first half takes (rotate_half convention, HF Llama), so a rotation is
        # x * cos + swap_halves(x) * sin: the same float32 values as (x1 cos - x2 sin,
        # x2 cos + x1 sin), in one product per table.
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), -1), persistent=False)
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), -1), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for positions [T] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by the tables of `RotaryEmbedding.forward`, in float32."""
    if norm_rope.fused_eager(x):
        return norm_rope.rotary(x, cos, sin)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((x2, x1), dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    """This rank's heads: q/k/v as one column-parallel product, o_proj row-parallel."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        shards = qkv_shards(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                            tp.rank, tp.size)
        d = cfg.head_dim
        self.num_heads = shards[0].size // d
        self.num_kv_heads = shards[1].size // d
        self.head_dim = d
        self.scale = d**-0.5
        self.qkv_proj = ColumnLinear(cfg.hidden_size, shards, bias=cfg.attention_bias)
        self.o_proj = RowLinear(cfg.num_attention_heads * d, cfg.hidden_size, "o_proj", tp=tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                fb: ForwardBatch) -> torch.Tensor:
        """x [T, hidden]; `rotary`: the pass's (cos, sin) from RotaryEmbedding.forward."""
        # Heads first, then split: the same views as splitting the features and reshaping each
        # part, but no view of a strided tensor, which makes a compiled graph whose batch size
        # may be 1 specialize on it (the CPU graph runner's bs 1 would need a graph of its own).
        heads, kv_heads = self.num_heads, self.num_kv_heads
        decode = fb.forward_mode.is_decode()  # Linear.forward: int8 activations only here
        qkv = self.qkv_proj(x, decode).unflatten(-1, (heads + 2 * kv_heads, self.head_dim))
        q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        out = fb.attn_backend.forward(q, k, v, self.layer_id, self.scale, fb)
        return self.o_proj(out.flatten(1), decode)


class MLP(nn.Module):
    """gate/up as one column-parallel product, down_proj row-parallel."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnLinear(
            cfg.hidden_size, [column_shard(n, inter, tp.rank, tp.size)
                              for n in ("gate_proj", "up_proj")])
        self.down_proj = RowLinear(inter, cfg.hidden_size, "down_proj", tp=tp)

    def forward(self, x: torch.Tensor, decode: bool = False,
                act_dtype: torch.dtype | None = None,
                float_rows: torch.Tensor | None = None) -> torch.Tensor:
        """`act_dtype`: the activations' dtype (default x's); float32 activations may arrive
        as their bf16 rounding (RMSNorm.for_product), which gate/up multiplies in bf16 anyway.
        `float_rows`: an extend's rows whose logits are read (Linear.forward)."""
        act_dtype = act_dtype or x.dtype
        # A bf16 product stays bf16 into silu_and_mul (one pass, float32 arithmetic), which
        # hands the down projection activations of the activations' dtype; as bf16, when down
        # multiplies these rows in bf16 too (silu_and_mul_product: the same bits, fewer passes).
        gate_up = self.gate_up_proj(x, decode, keep_bf16=True, float_rows=float_rows)
        if act_dtype == torch.float32:
            out = silu_and_mul_product(gate_up, self.down_proj, decode)
            if out is not None:
                return out
        return self.down_proj(silu_and_mul(gate_up, act_dtype), decode, float_rows=float_rows)


def logit_rows(fb: ForwardBatch) -> torch.Tensor | None:
    """The rows whose logits the forward reads (LlamaForCausalLM.forward keeps these for the
    lm_head; an extend's MLP keeps them off int8_blocks), or None when it reads every row or
    does not say (a calibration pass's batch carries only its
    attention: quant.int8_calibration)."""
    rows = getattr(fb, "logit_rows", None)
    if rows is not None:
        return rows
    last = getattr(fb, "last_token_indices", None)
    if last is not None and not getattr(fb, "return_all_logits", False):
        return last
    return None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rotary, fb):
        decode = fb.forward_mode.is_decode()
        h = self.input_layernorm.for_product(x, self.self_attn.qkv_proj, decode)
        x = x + self.self_attn(h, rotary, fb)
        h = self.post_attention_layernorm.for_product(x, self.mlp.gate_up_proj, decode)
        return x + self.mlp(h, decode, act_dtype=x.dtype,
                            float_rows=None if decode else logit_rows(fb))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg, max_positions)

    def forward(self, input_ids, positions, fb):
        x = self.embed_tokens(input_ids)
        rotary = self.rotary_emb(positions)  # one lookup for every layer
        for layer in self.layers:
            x = layer(x, rotary, fb)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None,
                 tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings, tp)
        shard = vocab_shard(cfg.vocab_size, tp.rank, tp.size, "lm_head")
        self.lm_head = ColumnLinear(cfg.hidden_size, [shard])
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.refine_logits = False  # enable_logit_refinement

    def enable_logit_refinement(self) -> bool:
        """Refine the top logits in float32 after a bfloat16 lm_head product (its output is
        rounded to bf16: 8 significant bits, steps of 0.125 at the default model's logits of
        16-32, so near-equal top tokens tie and the tie goes to the lower token id; the README's
        chat example once flipped its first token that way, "The" and "L" both -1.8997 after
        rounding, 0.08 apart in float32). Every pass, decode and extend alike, so a token does
        not depend on which kind of step produced it. Needs the float32 weight on the CPU (a
        tied lm_head keeps the embedding's) and the C++ operators; else off. Returns whether
        it is on."""
        w = self.lm_head.weight
        self.refine_logits = bool(
            self.lm_head.large_path == "bfloat16" and w is not None and w.device.type == "cpu"
            and w.dtype == torch.float32 and cpu_kernels.available())
        return self.refine_logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns float32 logits [rows, vocab], one row per
        sequence (its last token) unless `fb.return_all_logits`, then one row per token, or
        `fb.logit_rows` when set (the rows prompt logprobs need)."""
        hidden = self.model(input_ids, positions, fb)
        rows = logit_rows(fb)
        if rows is not None:
            hidden = hidden[rows]
        logits = self.lm_head(hidden, fb.forward_mode.is_decode()).float()
        if self.refine_logits and hidden.dtype == torch.float32:
            torch.ops.airserve.refine_top_logits_(logits, hidden, self.lm_head.weight,
                                                  self.lm_head.bias, REFINED_LOGITS)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits)[:, :self.config.vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy this rank's part of named tensors (HF naming) into the parameters; missing or
        unknown names raise."""
        targets = checkpoint_targets(self)
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name not in targets:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in the model")
            module, part, field = targets[name]
            if isinstance(module, (ColumnLinear, RowLinear)):
                module.load(part, field, tensor, name)
            elif isinstance(module, VocabParallelEmbedding):
                module.load(tensor, name)
            else:
                _copy_param(name, getattr(module, field), tensor)
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")

    def attach_packed_weights(self, weights: Iterable[tuple[str, PackedWeight]],
                              max_rows: int, activations: str = "float32",
                              drop_raw: bool = False,
                              drop_all: bool = False) -> tuple[dict[str, int], set[str]]:
        """Give linear layers this rank's part of the block-quantized copies of their weights
        (HF names; q/k/v and gate/up merged into one block weight each) for inputs of
        <= max_rows rows, products with `activations` ("float32" or "int8"). `drop_raw` frees
        the float weight of a layer with blocks of a `RAW_KINDS` kind (not a weight shared with
        the embedding); `drop_all` frees every such float weight (another matmul path is built
        from the blocks). A merged layer takes blocks only when all its parts have them.
        Returns ({kind: layers} for the report, checkpoint names whose float copy is freed)."""
        from airserve.srt.layers.quant.block_matvec import RAW_KINDS

        targets = checkpoint_targets(self, packed=True)
        roles = {id(m): n.rsplit(".", 1)[-1] for n, m in self.named_modules()}
        pending: dict[int, dict[str, PackedWeight]] = {}
        kinds: dict[str, int] = {}
        dropped: set[str] = set()
        for name, packed in weights:
            if name not in targets or not isinstance(targets[name][0], Linear):
                continue  # e.g. an untied embedding: its lookup reads one row
            layer, part, _ = targets[name]
            parts = pending.setdefault(id(layer), {})
            parts[part] = packed
            if set(parts) != set(layer.part_names):
                continue
            tied = layer is self.lm_head and self.config.tie_word_embeddings
            drop = not tied and (drop_all or drop_raw and any(p.kind in RAW_KINDS
                                                               for p in parts.values()))
            layer.attach_packed(layer.shard_packed(parts), max_rows, activations, drop)
            layer.packed_role = roles.get(id(layer), "")
            if drop:
                dropped |= {n for n, (m, _, f) in targets.items() if m is layer}
            for kind in layer.packed_kinds:
                kinds[kind] = kinds.get(kind, 0) + 1
        return kinds, dropped

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


# At most this many logits per row that refine_top_logits_ recomputes in float32.
REFINED_LOGITS = 8

_lib = torch.library.Library("airserve", "FRAGMENT")
# csrc/logits.cpp: in place, each row's logits within 2^-7 (relative) of its largest, at most
# max_k, recomputed in float32 as hidden . weight[token] (+ bias).
_lib.define("refine_top_logits_(Tensor(a!) logits, Tensor hidden, Tensor weight, Tensor? bias, "
            "int max_k) -> ()")


@torch.library.register_fake("airserve::refine_top_logits_")
def _refine_top_logits_fake(logits, hidden, weight, bias, max_k) -> None:
    return None


def checkpoint_targets(model: nn.Module, packed: bool = False
                       ) -> dict[str, tuple[nn.Module, str, str]]:
    """HF checkpoint name -> (module, part, "weight" | "bias") for every tensor the model loads
    (a layer without a float weight takes none). `packed`: block weights instead, where a tied
    embedding's blocks go to lm_head."""
    targets: dict[str, tuple[nn.Module, str, str]] = {}
    for path, module in model.named_modules():
        parent = path.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        if isinstance(module, (ColumnLinear, RowLinear)):
            fields = ["weight"] if packed else [
                f for f in ("weight", "bias") if getattr(module, f) is not None]
            for part in module.part_names:
                for field in fields:
                    targets[f"{prefix}{part}.{field}"] = (module, part, field)
        elif isinstance(module, VocabParallelEmbedding):
            targets[f"{path}.weight"] = (module, "embed_tokens", "weight")
        elif not packed:
            for field, _ in module.named_parameters(recurse=False):
                targets[f"{path}.{field}"] = (module, field, field)
    if model.config.tie_word_embeddings:
        targets.pop("lm_head.weight", None)
        if packed:
            targets["model.embed_tokens.weight"] = (model.lm_head, "lm_head", "weight")
    return targets


def _copy_param(name: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"the model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))
