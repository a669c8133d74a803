"""Find the model, read its config, build it and load its weights."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from airserve.srt.configs import ModelConfig
from airserve.srt.distributed.parallel_state import SINGLE, TPGroup
from airserve.srt.layers.quant.path_choice import BF16_RESIDUAL_CHANNELS, BF16_RESIDUAL_LAYERS
from airserve.srt.model_loader.gguf_dequant import RAW_TYPES
from airserve.srt.model_loader.model_path import (  # noqa: F401 - re-exported
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_INSTALL,
    DEFAULT_MODEL_PACKAGE,
    default_model_path,
    resolve_model_path,
)
from airserve.srt.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from airserve.srt.model_loader.gguf_loader import GGUFCheckpoint

logger = logging.getLogger(__name__)

# GGUF types held as split blocks beside a float32 copy, and as raw blocks only.
SPLIT_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def read_model_config(path: str) -> ModelConfig:
    """The config of a HF model directory (a GGUF's comes from its parsed header)."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise FileNotFoundError(f"{path} has no config.json; is it a HF model directory?")
    with open(cfg_file) as f:
        return ModelConfig.from_hf_dict(json.load(f))


def resolve_dtype(dtype: str, device: str, cfg: ModelConfig) -> torch.dtype:
    if device == "cpu" and dtype in ("auto", "bfloat16"):
        # Activations, norms, attention and the KV cache stay float32 on CPU: torch's bf16
        # matrix-vector products run at under half the fp32 speed on x86 hosts without AMX.
        # bf16 (--dtype bfloat16, or auto where it is fast) is a matmul path of the linear
        # layers for prefill and large batches: airserve.srt.layers.quant.matmul_paths.
        return torch.float32
    if dtype != "auto":
        return getattr(torch, dtype)
    if cfg.torch_dtype in ("float16", "bfloat16"):
        return getattr(torch, cfg.torch_dtype)
    return torch.bfloat16


def iter_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a HF model directory's safetensors files."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model_path: str | None, dtype: str, device: str,
               max_positions: int | None = None,
               packed_decode_max_bs: int = 0,
               keep_blocks: bool = False,
               decode_activations: str = "float32",
               tp: TPGroup = SINGLE,
               large_path: str = "float32",
               float32_matmul: str = "sgemm",
               int8_outlier_channels: int | None = None,
               large_activations: str = "float",
               ) -> tuple[ModelConfig, LlamaForCausalLM]:
    """Build the model (this rank's shard of it under tensor parallelism) and load its weights.
    A GGUF's block-quantized linear weights are also kept as blocks (cpu only) when
    `packed_decode_max_bs` > 0 (decode batches of up to that many rows multiply with them with
    float32 or int8 `decode_activations`, float32 models: airserve.srt.layers.quant.block_matvec)
    or `keep_blocks` (OpenVINO graphs use Q4_0/Q4_1/Q8_0 blocks as compressed weights:
    airserve.srt.layers.quant.openvino_linear).

    Q4_0/Q4_1/Q8_0 layers keep a float32 copy beside their blocks for larger batches. A layer
    with blocks of another packed type (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) is held only as blocks
    when the packed kernels run: larger batches dequantize them a chunk at a time
    (`Linear._dequantized_linear`).

    `large_path` (matmul_paths.PATHS; cpu) is how inputs above the packed limit multiply; a path
    other than float32 replaces the float32 weights with its own form (bf16 or packed int8),
    built from the blocks: those layers never load a float32 copy. With the float32 path,
    `float32_matmul` "onednn" reorders each float32 weight for oneDNN in place of the plain one
    (matmul_paths.FLOAT32_IMPLS; beside it for a tied lm_head, whose plain weight the
    embedding reads). w8a8_int8_outliers first finds each layer's `int8_outlier_channels`
    (None: matmul_paths.DEFAULT_OUTLIER_CHANNELS) outlier input channels by a calibration
    prefill (quant.int8_calibration). `large_activations` (--cpu-large-activations) gives
    some Q4_1 layers int8_blocks beside it (`int8_blocks_layers`, `Linear.set_large_int8`).
    """
    path = resolve_model_path(model_path)
    gguf = None  # parsed once: config, weights and packed blocks all come from it
    if path.endswith(".gguf"):
        from airserve.srt.model_loader.gguf_loader import load_gguf

        gguf = load_gguf(path)
    cfg = ModelConfig.from_hf_dict(gguf.config) if gguf else read_model_config(path)
    torch_dtype = resolve_dtype(dtype, device, cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, tp)
    model = model.to_empty(device=device)
    # Non-persistent buffers (RoPE tables) are rebuilt after leaving the meta device.
    rope = type(model.model.rotary_emb)(cfg, max_positions or cfg.max_position_embeddings)
    model.model.rotary_emb = rope.to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for param in model.parameters():
        param.data = param.data.to(torch_dtype)
    max_rows = 0
    if gguf is not None and (packed_decode_max_bs or keep_blocks):
        max_rows = packed_rows(device, torch_dtype, packed_decode_max_bs)
    blocks_only: set[str] = set()
    # Another large path builds its weights from the blocks: no float32 copy beside them.
    drop_all = bool(max_rows) and large_path != "float32"
    if max_rows or (keep_blocks and gguf is not None and device == "cpu"):
        # Before the float weights load: layers held as blocks only never get a float32 copy.
        types = (*SPLIT_TYPES, *RAW_TYPES) if max_rows else SPLIT_TYPES
        blocks_only = attach_packed(model, gguf, max_rows, decode_activations, types, drop_all)
    model.load_weights(gguf.tensors(skip=blocks_only) if gguf else iter_weights(path))
    model.eval().requires_grad_(False)
    if large_path != "float32" or float32_matmul != "sgemm" or large_activations == "int8":
        outliers = None
        if large_path in ("w8a8_int8_outliers", "bfloat16"):
            from airserve.srt.tokenizer import get_tokenizer

            outliers = large_path_outliers(model, get_tokenizer(path), large_path,
                                           int8_outlier_channels)
        set_large_path(model, large_path, float32_matmul, outliers, large_activations)
        if model.enable_logit_refinement():
            logger.info("bf16 lm_head: each row's top logits are recomputed in float32")
    logger.info("loaded %s (%s, %d layers) as %s on %s%s", path, cfg.model_type,
                cfg.num_hidden_layers, torch_dtype, device,
                f", tensor parallel rank {tp.rank} of {tp.size}" if tp.size > 1 else "")
    return cfg, model


def packed_rows(device: str, dtype: torch.dtype, max_rows: int) -> int:
    """The row limit the packed kernels can serve here (0: none; it logs why)."""
    from airserve.srt.layers.quant import block_matvec

    if device != "cpu":
        logger.info("GGUF blocks are kept on cpu only; %s uses its %s weights", device, dtype)
        return 0
    if max_rows and dtype != torch.float32:
        logger.info("packed GGUF decode is for float32 models; %s uses its weights", dtype)
        return 0
    if max_rows and not block_matvec.kernels_available():
        return 0  # kernels_available() logged why
    return max_rows


def attach_packed(model: LlamaForCausalLM, gguf: GGUFCheckpoint, max_rows: int,
                  activations: str, types: tuple[str, ...], drop_all: bool = False) -> set[str]:
    """Give the model the blocks of its GGUF tensors of `types` (q/k/v and gate/up merged);
    a layer with blocks of a `RAW_TYPES` type holds no float weight, nor (with `drop_all`) does
    any other layer but a tied lm_head. Returns the names of the tensors now held only as
    blocks (their float values are never read)."""
    kinds, dropped = model.attach_packed_weights(gguf.packed_tensors(types), max_rows,
                                                 activations, drop_raw=bool(max_rows),
                                                 drop_all=drop_all)
    if kinds:
        logger.info("kept GGUF blocks of %s%s; decode batches of <= %d rows multiply with them "
                    "(%s activations)", ", ".join(f"{n} {k} segments" for k, n in
                                                  sorted(kinds.items())),
                    f" ({len(dropped)} tensors with no float32 copy)" if dropped else "",
                    max_rows, activations)
    return dropped


def large_path_outliers(model: torch.nn.Module, tokenizer: object, path: str,
                        int8_outlier_channels: int | None = None) -> dict[str, torch.Tensor]:
    """The input channels, by layer name, that `path` multiplies in float32 beside its own
    product, from a calibration prefill of the model as it is (float32): every layer's
    `int8_outlier_channels` (None: the default) under w8a8_int8_outliers, the
    BF16_RESIDUAL_CHANNELS of the BF16_RESIDUAL_LAYERS under bfloat16; {} for other paths."""
    from airserve.srt.layers.quant.int8_calibration import find_outliers

    if path == "w8a8_int8_outliers":
        return find_outliers(model, tokenizer, int8_outlier_channels)
    if path == "bfloat16":
        found = find_outliers(model, tokenizer, BF16_RESIDUAL_CHANNELS)
        return {n: c for n, c in found.items() if n.rsplit(".", 1)[-1] in BF16_RESIDUAL_LAYERS}
    return {}


_DECODER_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def decoder_layer_index(name: str) -> int | None:
    """The decoder layer a module belongs to by its name ("model.layers.7.mlp.down_proj" -> 7),
    None outside the decoder stack (lm_head)."""
    found = _DECODER_LAYER.search(name)
    return int(found.group(1)) if found else None


def int8_blocks_layers(model: torch.nn.Module, large_activations: str, path: str
                       ) -> list[tuple[str, torch.nn.Module]]:
    """(module name, layer) of the linear layers that take int8_blocks under
    --cpu-large-activations `large_activations` when the large path is `path`
    (`Linear.takes_int8_blocks`, each with its decoder layer's place in the stack)."""
    from airserve.srt.layers.linear import Linear

    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    indices = [decoder_layer_index(n) for n, _ in layers]
    n_layers = max((i for i in indices if i is not None), default=-1) + 1
    return [(n, m) for (n, m), i in zip(layers, indices)
            if m.takes_int8_blocks(large_activations, path, i, n_layers)]


def set_large_path(model: torch.nn.Module, path: str, float32_impl: str = "sgemm",
                   outliers: dict[str, torch.Tensor] | None = None,
                   large_activations: str = "float") -> int:
    """Give every linear layer the weight form of `path` (float32: by `float32_impl`) for
    inputs above the packed limit, and int8_blocks' beside it where `large_activations` gives
    it the layer (`int8_blocks_layers`); a weight shared with an
    embedding (tied lm_head) stays for the lookups. `outliers`: each layer's float32 input
    channels by module name (w8a8_int8_outliers). Returns how many layers changed."""
    from airserve.srt.layers.embedding import VocabParallelEmbedding
    from airserve.srt.layers.linear import Linear
    from airserve.srt.layers.quant.matmul_paths import prepack_fp16_many

    embeddings = (torch.nn.Embedding, VocabParallelEmbedding)
    shared = {m.weight.data_ptr() for m in model.modules() if isinstance(m, embeddings)}
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    fp16 = {}  # fbgemm packs on one core: the float16 weights a layer per thread
    if path == "float16_weights":
        sources = [(n, m) for n, m in layers if m.has_weight_source]
        fp16 = dict(zip([n for n, _ in sources],
                        prepack_fp16_many([m.float_weight for _, m in sources],
                                          torch.get_num_threads())))
    for name, layer in layers:
        tied = layer.weight is not None and layer.weight.data_ptr() in shared
        layer.set_large_path(path, keep_float=tied, float32_impl=float32_impl,
                             outliers=(outliers or {}).get(name), fp16_prepacked=fp16.get(name))
    residual = sorted({n.rsplit(".", 1)[-1] for n in outliers or {}}) if path == "bfloat16" else []
    roles = set()
    for name, layer in int8_blocks_layers(model, large_activations, path):
        layer.set_large_int8(True)
        roles.add(name.rsplit(".", 1)[-1])
    int8 = sorted(roles)
    logger.info("linear layers multiply inputs above the packed limit through %s%s%s%s", path,
                f" ({float32_impl})" if path == "float32" else "",
                f" ({', '.join(residual)} with float32 residual channels)" if residual else "",
                f"; {', '.join(int8)} through int8_blocks (int8 activations) but the prompt rows "
                f"whose logits are read" if int8 else "")
    return len(layers)
