"""Dequantize GGML tensor data to float32 with numpy.

Block layouts follow ggml (`ggml-common.h`, `dequantize_row_*` in `ggml-quants.c`). Every block
type stores whole blocks along a row, so a tensor's bytes are `n_elements / block_size` blocks of
`type_size` bytes laid end to end, little-endian.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

QK_K = 256

# ggml_type id -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 2 + 16),
    3: ("Q4_1", 32, 2 + 2 + 16),
    6: ("Q5_0", 32, 2 + 4 + 16),
    7: ("Q5_1", 32, 2 + 2 + 4 + 16),
    8: ("Q8_0", 32, 2 + 32),
    12: ("Q4_K", QK_K, 2 + 2 + 12 + QK_K // 2),
    13: ("Q5_K", QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    14: ("Q6_K", QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    30: ("BF16", 1, 2),
}


def ggml_type_name(ggml_type: int) -> str:
    if int(ggml_type) in GGML_TYPES:
        return GGML_TYPES[int(ggml_type)][0]
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(int(ggml_type)).name
    except (ImportError, ValueError):
        return f"ggml type {int(ggml_type)}"


def _block_layout(ggml_type: int) -> tuple[str, int, int]:
    layout = GGML_TYPES.get(int(ggml_type))
    if layout is None:
        supported = ", ".join(name for name, _, _ in GGML_TYPES.values())
        raise ValueError(
            f"Cannot dequantize GGUF tensor type {ggml_type_name(ggml_type)}; "
            f"supported types: {supported}. Re-quantize the model to one of them."
        )
    return layout


def tensor_nbytes(ggml_type: int, n_elements: int) -> int:
    """Bytes a tensor of `n_elements` elements of `ggml_type` occupies in a GGUF file."""
    name, block_size, type_size = _block_layout(ggml_type)
    if n_elements % block_size:
        raise ValueError(f"{n_elements} elements is not a whole number of {name} blocks")
    return n_elements // block_size * type_size


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    # block: d f16 | qs int8[32]; x = d * q
    return _f16(blocks, 0) * blocks[:, 2:].view(np.int8).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # ggml packs element j in the low nibble of byte j and element j + 16 in the high nibble.
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _dequant_q4_0(blocks: np.ndarray) -> np.ndarray:
    # block: d f16 | qs u8[16]; x = d * (q - 8)
    q = _nibbles(blocks[:, 2:]).astype(np.float32) - 8.0
    return _f16(blocks, 0) * q


def _dequant_q4_1(blocks: np.ndarray) -> np.ndarray:
    # block: d f16 | m f16 | qs u8[16]; x = d * q + m
    q = _nibbles(blocks[:, 4:]).astype(np.float32)
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 qh (4 bytes per block, little-endian 32 bits) -> bit j of value j, as 0/16."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [n, 32]: bit j of the u32
    return bits.astype(np.uint8) << 4


def _dequant_q5_0(blocks: np.ndarray) -> np.ndarray:
    # block: d f16 | qh u8[4] | qs u8[16]; x = d * (q - 16), bit 4 of value j in bit j of qh
    q = (_nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])).astype(np.float32) - 16.0
    return _f16(blocks, 0) * q


def _dequant_q5_1(blocks: np.ndarray) -> np.ndarray:
    # block: d f16 | m f16 | qh u8[4] | qs u8[16]; x = d * q + m
    q = (_nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8])).astype(np.float32)
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _q4_k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack 12 bytes into eight 6-bit scales and eight 6-bit mins, each [n_blocks, 8]."""
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _dequant_q4_k(blocks: np.ndarray) -> np.ndarray:
    # super-block: d f16 | dmin f16 | scales u8[12] | qs u8[128]; eight sub-blocks of 32.
    # x = d * sc[j] * q - dmin * m[j]
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _q4_k_scales_mins(blocks[:, 4:16])
    # Each 32-byte chunk c of qs holds sub-block 2c in its low nibbles, 2c + 1 in its high.
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)
    x = (d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]
    return x.reshape(n, QK_K)


def _dequant_q5_k(blocks: np.ndarray) -> np.ndarray:
    # super-block: d f16 | dmin f16 | scales u8[12] | qh u8[32] | qs u8[128]; like Q4_K, with
    # bit 4 of value l of sub-block j in bit j of qh[l].
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _q4_k_scales_mins(blocks[:, 4:16])
    qh = blocks[:, 16:48].reshape(n, 1, 32)
    qs = blocks[:, 48:].reshape(n, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = (low | (high << 4)).astype(np.float32)
    x = (d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]
    return x.reshape(n, QK_K)


_Q6_K_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def _dequant_q6_k(blocks: np.ndarray) -> np.ndarray:
    # super-block: ql u8[128] | qh u8[64] | scales i8[16] | d f16; sixteen sub-blocks of 16.
    # Each 128-element half h uses ql[64h:64h+64] and qh[32h:32h+32]; element 32k + l (k < 4,
    # l < 32) takes its low 4 bits from ql[l + 32 (k % 2)] (low nibble for k < 2, high after)
    # and its high 2 bits from bits 2k..2k+1 of qh[l]. x = d * scale[sub-block] * (q - 32).
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 2, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks, 208)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [n, 2, 4, 32]
    high = (qh >> _Q6_K_SHIFTS) & 3
    q = ((low | (high << 4)).astype(np.int8) - 32).astype(np.float32)
    x = (d * scales)[:, :, None] * q.reshape(n, 16, 16)
    return x.reshape(n, QK_K)


_BLOCK_DEQUANT: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q8_0": _dequant_q8_0,
    "Q4_0": _dequant_q4_0,
    "Q4_1": _dequant_q4_1,
    "Q5_0": _dequant_q5_0,
    "Q5_1": _dequant_q5_1,
    "Q4_K": _dequant_q4_k,
    "Q5_K": _dequant_q5_k,
    "Q6_K": _dequant_q6_k,
}


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...] | list[int]) -> np.ndarray:
    """Dequantize one GGUF tensor's data to a float32 array of `shape`.

    `raw` is the tensor's bytes (uint8) or the same bytes as a typed array (e.g. the float16 array
    a reader returns for an F16 tensor). `shape` is in numpy/torch order, i.e. GGUF's dims
    reversed, so `shape[-1]` is the row that blocks run along. Raises ValueError for a type not
    in `GGML_TYPES` or data whose size does not match.
    """
    name, block_size, type_size = _block_layout(ggml_type)
    shape = tuple(int(s) for s in shape)
    n_elements = int(np.prod(shape, dtype=np.int64))
    if shape and shape[-1] % block_size:
        raise ValueError(f"{name} rows need a multiple of {block_size} elements, got {shape}")
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    expected = n_elements // block_size * type_size
    if data.size != expected:
        raise ValueError(f"{name} tensor of shape {shape} needs {expected} bytes, got {data.size}")
    if name == "F32":
        out = data.view(np.float32).copy()
    elif name == "F16":
        out = data.view(np.float16).astype(np.float32)
    elif name == "BF16":
        out = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        out = _BLOCK_DEQUANT[name](data.reshape(-1, type_size))
    return out.reshape(shape)


# Types whose blocks `pack_blocks` keeps, for the decode kernels of
# airserve.srt.layers.quant.block_matvec: Q4_0 (carried as Q4_1 with m = -8 d, exact in fp16),
# Q4_1 and Q8_0 split into values and scales; the others (`RAW_TYPES`) as the file's bytes.
RAW_TYPES = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
PACKABLE_TYPES = ("Q4_0", "Q4_1", "Q8_0", *RAW_TYPES)


def pack_blocks(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...] | list[int]):
    """A 2-D tensor of a `PACKABLE_TYPES` type as (kind, qs, d, m) numpy arrays with one row per
    output row ([N, ...]; d and m None for `RAW_TYPES`, whose qs rows are the raw blocks), or None
    for other types. `shape` is numpy order [N, K]."""
    name, block_size, type_size = _block_layout(ggml_type)
    if name not in PACKABLE_TYPES or len(shape) != 2:
        return None
    rows = int(shape[0])
    if name in RAW_TYPES:
        return name.lower(), raw.reshape(rows, -1), None, None
    blocks = raw.reshape(rows, -1, type_size)

    def f16(start: int) -> np.ndarray:
        return blocks[:, :, start : start + 2].copy().view(np.float16)[..., 0]

    if name == "Q8_0":
        return "q8_0", blocks[:, :, 2:].view(np.int8).reshape(rows, -1), f16(0), None
    if name == "Q4_1":
        return "q4_1", blocks[:, :, 4:].reshape(rows, -1), f16(0), f16(2)
    d = f16(0)
    return "q4_1", blocks[:, :, 2:].reshape(rows, -1), d, (d * np.float16(-8)).astype(np.float16)
