"""Load a GGUF checkpoint as a HuggingFace-style config, float32 tensors and a tokenizer.

The file header is parsed here rather than with `gguf.GGUFReader`, which takes seconds on a
49k-token vocabulary (it builds one numpy view per array element); tensor data is memory-mapped
and dequantized lazily by `gguf_dequant`.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from airserve.srt.model_loader.gguf_dequant import (
    dequantize,
    ggml_type_name,
    pack_blocks,
    tensor_nbytes,
)
from airserve.srt.model_loader.gguf_tokenizer import build_tokenizer

if TYPE_CHECKING:  # the HTTP process reads a GGUF's tokenizer from here without torch
    import torch

    from airserve.srt.layers.quant.block_matvec import PackedWeight

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# general.architecture -> (HF model_type, HF architectures[0])
SUPPORTED_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# llama.cpp's converter interleaves the rotary halves of Q and K for these architectures only
# (the others use NeoX-style RoPE in llama.cpp and are stored as in HF).
_PERMUTED_QK_ARCHS = ("llama",)

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors llama.cpp writes that have no HF counterpart in these architectures.
_IGNORED_TENSORS = {"rope_freqs.weight"}

# GGUF value type -> struct format of one scalar
_SCALAR_FMT = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    shape: tuple[int, ...]  # torch order: GGUF's dims reversed, e.g. [out, in]
    ggml_type: int
    offset: int  # absolute byte offset of the data in the file


class _HeaderReader:
    """Sequential little-endian reader over the mapped file."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _SCALAR_FMT:
                fmt = _SCALAR_FMT[item_type]
                size = struct.calcsize(fmt)
                arr = np.frombuffer(self.buf, dtype=fmt, count=count, offset=self.pos)
                self.pos += size * count
                return arr.tolist()
            return [self.value(item_type) for _ in range(count)]
        if vtype in _SCALAR_FMT:
            return self.scalar(_SCALAR_FMT[vtype])
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")


def _read_header(buf: mmap.mmap, path: str) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    r = _HeaderReader(buf, path)
    r.pos = 4
    version = r.scalar("<I")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is too old; re-convert with llama.cpp")
    n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        metadata[key] = r.value(r.scalar("<I"))
    raw_infos = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.scalar("<Q") for _ in range(r.scalar("<I"))]
        raw_infos.append((name, tuple(reversed(dims)), r.scalar("<I"), r.scalar("<Q")))
    align = int(metadata.get("general.alignment", 32))
    data_start = (r.pos + align - 1) // align * align
    infos = [GGUFTensorInfo(n, s, t, data_start + off) for n, s, t, off in raw_infos]
    return metadata, infos


def _open_gguf(path: str) -> mmap.mmap:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF Llama-style name for a GGUF tensor name, or None if it has no counterpart."""
    if gguf_name in _IGNORED_TENSORS:
        return None
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS and kind in ("weight", "bias"):
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no mapping to a HF Llama-style name")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF rotate_half halves).

    llama.cpp stores row `2j + r` of each head as HF row `r * head_dim / 2 + j`; `w` is
    [n_head * head_dim, ...] (a weight or a bias).
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _meta(metadata: dict[str, Any], key: str, path: str) -> Any:
    if key not in metadata:
        raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
    return metadata[key]


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind is None and metadata.get(f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", metadata[f"{arch}.rope.scale_linear"]
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        logger.warning("GGUF RoPE scaling type %r is not supported; it is ignored", kind)
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def build_hf_config(
    metadata: dict[str, Any], tensor_infos: list[GGUFTensorInfo], path: str = "<gguf>"
) -> dict[str, Any]:
    """HF `config.json`-style dict from GGUF metadata."""
    arch = _meta(metadata, "general.architecture", path)
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    model_type, hf_arch = SUPPORTED_ARCHS[arch]
    names = {t.name: t for t in tensor_infos}
    hidden = int(_meta(metadata, f"{arch}.embedding_length", path))
    heads = int(_meta(metadata, f"{arch}.attention.head_count", path))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = metadata.get(f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        logger.warning("GGUF rotates %s of %d head dims; airserve rotates all", rope_dim, head_dim)
    vocab = metadata.get(f"{arch}.vocab_size") or names["token_embd.weight"].shape[0]
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_arch],
        "hidden_size": hidden,
        "intermediate_size": int(_meta(metadata, f"{arch}.feed_forward_length", path)),
        "num_hidden_layers": int(_meta(metadata, f"{arch}.block_count", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(_meta(metadata, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_meta(metadata, f"{arch}.context_length", path)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if "rope_freqs.weight" in names:
        logger.warning(
            "%s: rope_freqs.weight (Llama 3.1-style RoPE frequency scaling) is not applied; "
            "outputs will drift from the reference model",
            path,
        )
    scaling = _rope_scaling(metadata, arch)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


@dataclass
class GGUFCheckpoint:
    """A parsed GGUF file. `tensors()` dequantizes on demand from the memory-mapped file."""

    path: str
    config: dict[str, Any]
    tokenizer_info: dict[str, Any]
    metadata: dict[str, Any] = field(repr=False)
    tensor_infos: list[GGUFTensorInfo] = field(repr=False)
    _buf: mmap.mmap = field(repr=False)

    def _raw_tensors(self) -> Iterator[tuple[str, GGUFTensorInfo, np.ndarray]]:
        """`(hf_name, info, raw bytes)` for every tensor with a HF counterpart, in file order."""
        for info in self.tensor_infos:
            name = hf_tensor_name(info.name)
            if name is None:
                continue
            n_elements = int(np.prod(info.shape, dtype=np.int64))
            try:
                nbytes = tensor_nbytes(info.ggml_type, n_elements)
            except ValueError as e:
                raise ValueError(f"{self.path}: tensor {info.name}: {e}") from e
            yield name, info, np.frombuffer(self._buf, dtype=np.uint8, count=nbytes,
                                            offset=info.offset)

    def _unpermute(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Undo llama.cpp's Q/K row order for `rows` ([N, ...]) of tensor `name`."""
        if self.metadata["general.architecture"] not in _PERMUTED_QK_ARCHS:
            return rows
        if ".self_attn.q_proj." in name:
            return unpermute_qk(rows, self.config["num_attention_heads"])
        if ".self_attn.k_proj." in name:
            return unpermute_qk(rows, self.config["num_key_value_heads"])
        return rows

    def tensors(self, skip: frozenset[str] | set[str] = frozenset()
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(hf_name, float32 tensor)` in file order, Q/K un-permuted for llama; the names
        in `skip` are neither read nor yielded."""
        import torch

        for name, info, raw in self._raw_tensors():
            if name in skip:
                continue
            try:
                w = dequantize(raw, info.ggml_type, info.shape)
            except ValueError as e:
                raise ValueError(f"{self.path}: tensor {info.name}: {e}") from e
            yield name, torch.from_numpy(np.ascontiguousarray(self._unpermute(name, w)))

    def packed_tensors(self, types: tuple[str, ...] | None = None
                       ) -> Iterator[tuple[str, PackedWeight]]:
        """Yield `(hf_name, PackedWeight)` for the 2-D tensors of a `PACKABLE_TYPES` type (or
        of `types`, GGML names such as "Q4_K"), blocks kept as stored (rows un-permuted like
        `tensors()`), for the block-quantized decode kernels."""
        import torch

        from airserve.srt.layers.quant.block_matvec import PackedWeight

        for name, info, raw in self._raw_tensors():
            if types is not None and ggml_type_name(info.ggml_type) not in types:
                continue
            packed = pack_blocks(raw, info.ggml_type, info.shape)
            if packed is None:
                continue
            kind, *parts = packed
            # np.array copies: raw blocks would otherwise be views of the read-only mapping.
            qs, d, m = (None if a is None else torch.from_numpy(np.array(self._unpermute(name, a)))
                        for a in parts)
            yield name, PackedWeight(kind, qs, d, m)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors())

    def tensor_types(self) -> dict[str, str]:
        """GGUF name -> GGML type name, e.g. {"blk.0.attn_q.weight": "Q4_1"}."""
        return {t.name: ggml_type_name(t.ggml_type) for t in self.tensor_infos}


def load_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """Parse a GGUF file: config (HF form), tokenizer, and a lazy tensor iterator.

    Raises FileNotFoundError for a missing file and ValueError for a file that is not GGUF,
    an unsupported architecture or tokenizer, or missing metadata; every message names the path.
    """
    path = os.fspath(path)
    buf = _open_gguf(path)
    try:
        metadata, infos = _read_header(buf, path)
    except (struct.error, ValueError) as e:
        raise ValueError(f"{path}: cannot parse GGUF header: {e}") from e
    config = build_hf_config(metadata, infos, path)
    try:
        for info in infos:
            hf_tensor_name(info.name)
    except ValueError as e:
        raise ValueError(f"{path}: {e} (architecture {metadata['general.architecture']})") from e
    try:
        tokenizer_info = build_tokenizer(metadata)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{path}: cannot build tokenizer: {e}") from e
    return GGUFCheckpoint(path, config, tokenizer_info, metadata, infos, buf)
