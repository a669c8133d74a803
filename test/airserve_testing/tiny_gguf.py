"""A tiny GGUF model written in code the way llama.cpp's converter writes one (tests only)."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from airserve.srt.layers.quant.block_matvec import PackedWeight
from airserve.srt.model_loader.gguf_quantize import quantize


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


MERGES = ["h e", "Ġ t", "Ġt he", "Ġ 1", "1 2", "12 3"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = [*SPECIAL, *bytes_to_unicode().values()]
    tokens += ["".join(m.split(" ")) for m in MERGES] + ["<think>"]
    types = [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL) - 1) + [4]
    return tokens, types


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q/K rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def dims(arch: str, wide: bool = False) -> dict[str, int]:
    # transformers' GGUF config for qwen3 ignores attention.key_length and keeps Qwen3's
    # head_dim of 128, so the qwen3 file uses 128 too. `wide`: every K a multiple of 256, for
    # K-quants.
    if wide:
        return dict(hidden=256, inter=512, layers=2, heads=4, kv_heads=2, head_dim=64)
    return dict(
        hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=128 if arch == "qwen3" else 16
    )


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def hf_weights(arch: str, vocab: int, tied: bool, wide: bool = False
               ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    d = dims(arch, wide)
    q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    shapes = {
        "model.embed_tokens.weight": (vocab, d["hidden"]),
        "model.norm.weight": (d["hidden"],),
    }
    if not tied:
        shapes["lm_head.weight"] = (vocab, d["hidden"])
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, d["hidden"]),
            p + "self_attn.k_proj.weight": (kv, d["hidden"]),
            p + "self_attn.v_proj.weight": (kv, d["hidden"]),
            p + "self_attn.o_proj.weight": (d["hidden"], q),
            p + "mlp.gate_proj.weight": (d["inter"], d["hidden"]),
            p + "mlp.up_proj.weight": (d["inter"], d["hidden"]),
            p + "mlp.down_proj.weight": (d["hidden"], d["inter"]),
            p + "input_layernorm.weight": (d["hidden"],),
            p + "post_attention_layernorm.weight": (d["hidden"],),
        }
        if arch == "qwen2":
            shapes |= {
                p + f"self_attn.{x}_proj.bias": (n,) for x, n in (("q", q), ("k", kv), ("v", kv))
            }
        if arch == "qwen3":
            shapes |= {p + f"self_attn.{x}_norm.weight": (d["head_dim"],) for x in "qk"}
    return {
        k: torch.randn(s, generator=g) * 0.2 + (1.0 if len(s) == 1 else 0.0)
        for k, s in shapes.items()
    }


def gguf_name(hf: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{GGUF_NAMES[module]}.{kind}"


def write_tiny_gguf(path: str, arch: str, pre: str = "smollm", tied: bool = True,
                     qtypes: dict[str, T] | None = None, wide: bool = False) -> dict:
    """Write a 2-layer model the way llama.cpp's converter would; return the HF weights.
    `qtypes` maps a name suffix (e.g. "q_proj.weight") to the GGML type to store it as (K-quants
    need `wide`)."""
    tokens, types = tiny_vocab()
    weights = hf_weights(arch, len(tokens), tied, wide)
    d = dims(arch, wide)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(d["layers"])
    w.add_context_length(256)
    w.add_embedding_length(d["hidden"])
    w.add_feed_forward_length(d["inter"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv_heads"])
    w.add_key_length(d["head_dim"])
    w.add_value_length(d["head_dim"])
    w.add_rope_dimension_count(d["head_dim"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{{ messages[0]['content'] }}")
    for name, t in weights.items():
        if arch == "llama" and "q_proj.weight" in name:
            t = llama_cpp_permute(t, d["heads"])
        elif arch == "llama" and "k_proj.weight" in name:
            t = llama_cpp_permute(t, d["kv_heads"])
        a = t.numpy().astype(np.float32)
        qtype = next((q for suffix, q in (qtypes or {}).items() if name.endswith(suffix)), None)
        if qtype is not None:
            w.add_tensor(gguf_name(name), quantize(a, qtype.name), raw_dtype=qtype)
        elif name.endswith(("q_proj.weight", "up_proj.weight")):
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, T.Q8_0), raw_dtype=T.Q8_0)
        elif "o_proj" in name:
            w.add_tensor(gguf_name(name), a.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights



# Every block type the packed paths take (Q4_0 and Q4_1 and Q8_0), on every kind of linear layer.
PACKED_TYPES = {"q_proj.weight": T.Q4_1, "k_proj.weight": T.Q4_0, "v_proj.weight": T.Q8_0,
                 "o_proj.weight": T.Q4_1, "gate_proj.weight": T.Q4_1, "up_proj.weight": T.Q4_0,
                 "down_proj.weight": T.Q4_1, "embed_tokens.weight": T.Q8_0}


# A Q4_K_M-like mix (llama.cpp gives attn_v and ffn_down more bits) plus every other packed type.
K_QUANT_TYPES = {"q_proj.weight": T.Q4_K, "k_proj.weight": T.Q5_K, "v_proj.weight": T.Q6_K,
                 "o_proj.weight": T.Q5_0, "gate_proj.weight": T.Q4_K, "up_proj.weight": T.Q5_1,
                 "down_proj.weight": T.Q6_K, "embed_tokens.weight": T.Q8_0}


def random_packed(kind: str, n: int, k: int, seed: int = 0, flat_block: bool = False
                  ) -> PackedWeight:
    """Random GGML blocks of a [n, k] weight: "q4_1" or "q8_0". `flat_block` makes the first
    Q4_1 block constant (d = 0, all values m), as the quantizer writes for flat data."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half()
    if kind == "q8_0":
        return PackedWeight(kind, torch.randint(-128, 128, (n, k), generator=g,
                                                dtype=torch.int8), d, None)
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).half()
    if flat_block:
        d[0, 0] = 0
    return PackedWeight(kind, torch.randint(0, 256, (n, k // 2), generator=g,
                                            dtype=torch.uint8), d, m)


# Byte offsets of the fp16 scales inside one raw block, so random blocks get finite scales.
RAW_F16_OFFSETS = {"q5_0": [0], "q5_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}


def random_raw_packed(kind: str, n: int, k: int, seed: int = 0) -> PackedWeight:
    """Random GGML blocks (every bit pattern, fp16 scales ~0.01) of a [n, k] weight of one of
    block_matvec.RAW_KINDS, as the loader keeps them: raw bytes, one row per output row."""
    from airserve.srt.layers.quant.block_matvec import RAW_KINDS

    values, nbytes = RAW_KINDS[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // values, nbytes), dtype=np.uint8)
    for off in RAW_F16_OFFSETS[kind]:
        scale = rng.normal(0, 0.01, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8)
    return PackedWeight(kind, torch.from_numpy(blocks.reshape(n, -1)), None, None)


def any_packed(kind: str, n: int, k: int, seed: int = 0) -> PackedWeight:
    """Random blocks of any kind the packed kernels take."""
    if kind in ("q4_1", "q8_0"):
        return random_packed(kind, n, k, seed)
    return random_raw_packed(kind, n, k, seed)


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> the float64 values the int8 products' activations stand for: per
    block of 32, scale max|x| / 127 and values rounded half to even (block_matmul_int8,
    gemm_int8_blocks)."""
    b = x.view(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(b * inv).double() * d.double()).view_as(x)
