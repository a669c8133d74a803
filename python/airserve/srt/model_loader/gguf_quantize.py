"""Quantize float32 weights to GGML K-quant blocks (Q4_K, Q5_K, Q6_K) with numpy.

The `gguf` package quantizes the 32-value block types but not the K-quants; tests and the
fidelity/benchmark scripts make K-quant files with these. The rounding is plain min/max (not
llama.cpp's error-minimizing search), so a file made here is a little less accurate than
llama.cpp's quantize would make it; the block layouts are exactly ggml's (`block_q4_K` etc.) and
`gguf.quants.dequantize` reads them back (test/srt/model_loader/test_gguf_kquants.py).
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """float values [n] -> their fp16 bytes [n, 2]."""
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _superblocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % QK_K:
        raise ValueError(f"K-quants need rows of a multiple of {QK_K} values, got {x.shape}")
    return x.reshape(-1, QK_K)


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per super-block [n, 8] -> ggml's 12-byte packing [n, 12]."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _asymmetric(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Super-blocks [n, 256] -> q [n, 8, 32] in 0..levels, d, dmin [n], 6-bit sc, mn [n, 8]."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    scale = (sub.max(axis=2) - lo) / levels
    d = scale.max(axis=1) / 63
    dmin = (-lo).max(axis=1) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    safe = np.where(d > 0, d, 1)[:, None]
    sc = np.clip(np.rint(scale / safe), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[:, :, None]
    q = np.rint((sub + (dmin[:, None] * mn)[:, :, None]) / np.where(step > 0, step, 1))
    return np.clip(q, 0, levels).astype(np.uint8), d, dmin, sc, mn


def _nibble_chunks(q: np.ndarray) -> np.ndarray:
    """q [n, 8, 32] (4 low bits used) -> qs [n, 128]: chunk c holds sub-block 2c in its low
    nibbles and 2c + 1 in its high nibbles."""
    pairs = q.reshape(-1, 4, 2, 32) & 15
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [..., K] (K a multiple of 256) -> Q4_K bytes [..., K / 256 * 144]."""
    q, d, dmin, sc, mn = _asymmetric(_superblocks(x), 15)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales_k4(sc, mn),
                             _nibble_chunks(q)], axis=1)
    return blocks.reshape(*np.shape(x)[:-1], -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """float32 [..., K] (K a multiple of 256) -> Q5_K bytes [..., K / 256 * 176]."""
    q, d, dmin, sc, mn = _asymmetric(_superblocks(x), 31)
    high = (q >> 4).reshape(-1, 8, 32).astype(np.uint8)  # bit 4 of each value
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for j in range(8):  # sub-block j's high bits go to bit j of qh[l]
        qh |= high[:, j] << j
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales_k4(sc, mn), qh,
                             _nibble_chunks(q)], axis=1)
    return blocks.reshape(*np.shape(x)[:-1], -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [..., K] (K a multiple of 256) -> Q6_K bytes [..., K / 256 * 210]."""
    sub = _superblocks(x).reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31
    d = (scale.max(axis=1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    step = (d[:, None] * sc)[:, :, None]
    q = np.clip(np.rint(sub / np.where(step > 0, step, 1)), -32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)  # [n, half, k, l]: value 128 h + 32 k + l
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2)  # [n, 2, 64]
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6))  # [n, 2, 32]
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                             _f16_bytes(d)], axis=1)
    return blocks.reshape(*np.shape(x)[:-1], -1)


K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [..., K] -> GGML blocks of `type_name` (uint8 [..., bytes per row]): the K-quants
    here, every other type through `gguf.quants.quantize`."""
    if type_name in K_QUANTIZERS:
        return K_QUANTIZERS[type_name](x)
    import gguf

    return gguf.quants.quantize(np.asarray(x, np.float32),
                                gguf.GGMLQuantizationType[type_name])


# Requantization schemes named like llama.cpp's file types: (type of most linear weights, type
# of attn_v and ffn_down, which the "_M" mixes give more bits; llama.cpp gives them to about
# half of the ffn_down layers, here to all). Rows that are not a multiple of 256 values take the
# 32-value type llama.cpp falls back to (`K_FALLBACK`).
SCHEMES = {
    "Q4_K_M": ("Q4_K", "Q6_K"),
    "Q5_K_M": ("Q5_K", "Q6_K"),
    "Q6_K": ("Q6_K", "Q6_K"),
    "Q5_0": ("Q5_0", "Q5_0"),
    "Q5_1": ("Q5_1", "Q5_1"),
    "Q8_0": ("Q8_0", "Q8_0"),
    "Q4_0": ("Q4_0", "Q4_0"),
}
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def scheme_type(scheme: str, name: str, k: int) -> str:
    """The GGML type `scheme` stores the [N, k] weight of layer `name` (HF naming) as."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    main, more = SCHEMES[scheme]
    t = more if name.endswith(("v_proj", "down_proj")) else main
    return K_FALLBACK[t] if t in K_FALLBACK and k % QK_K else t


def requantize_linears(model, scheme: str, max_rows: int, activations: str) -> dict[str, int]:
    """Store every linear layer of `model` that has a float weight (a shared embedding/lm_head
    keeps its blocks) as `scheme` blocks for the packed kernels, dropping the float weight
    where a type is a blocks-only one. A merged layer (q/k/v, gate/up) quantizes each part with
    its own type. Returns {GGML type: parts}."""
    import torch
    from gguf import GGMLQuantizationType

    from airserve.srt.layers.linear import Linear
    from airserve.srt.layers.quant.block_matvec import PackedWeight
    from airserve.srt.model_loader.gguf_dequant import RAW_TYPES, pack_blocks

    shared = {id(p) for n, m in model.named_modules() if not isinstance(m, Linear)
              for p in m.parameters(recurse=False)}
    counts: dict[str, int] = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear) or layer.weight is None or id(layer.weight) in shared:
            continue
        k = layer.weight.shape[1]
        parent = name.rpartition(".")[0]
        shards = getattr(layer, "shards", None)
        sizes = [(f"{parent}.{s.name}", s.size) for s in shards] if shards else \
            [(name, layer.weight.shape[0])]
        parts, types, row = [], [], 0
        for part_name, n in sizes:
            t = scheme_type(scheme, part_name, k)
            w = layer.weight[row:row + n].detach().float().numpy()
            raw = quantize(w, t).reshape(-1)
            kind, *arrays = pack_blocks(raw, int(GGMLQuantizationType[t]), (n, k))
            qs, d, m = (None if a is None else torch.from_numpy(np.array(a)) for a in arrays)
            parts.append(PackedWeight(kind, qs, d, m))
            types.append(t)
            counts[t] = counts.get(t, 0) + 1
            row += n
        drop = any(t in RAW_TYPES for t in types)
        if not drop:  # the float copy must hold the new values too
            with torch.no_grad():
                layer.weight.copy_(torch.cat([p.dequantize() for p in parts]))
        layer.attach_packed(parts, max_rows, activations, drop_weight=drop)
        layer.packed_role = name.rsplit(".", 1)[-1]
    return counts
