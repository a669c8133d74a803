"""One product for both sides of a layer's packed limit, chosen by the row count at run time.

`Linear.forward` picks the packed block product for inputs of 1..`packed_max_rows` rows and the
layer's large path above. In a graph compiled for a symbolic batch size that choice would be a
guard on the size, so the buckets on each side would need a graph of their own (two inductor
compiles at start-up). `airserve::packed_or_large` (csrc/packed_or_large.cpp) makes the same
choice when it runs and calls the same operators, so one graph serves every bucket with each
batch on the path eager code takes for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from airserve.srt.layers.quant.block_matvec import KINDS
from airserve.srt.layers.quant.matmul_paths import INT8_PATHS

if TYPE_CHECKING:
    from airserve.srt.layers.linear import Linear


_lib = torch.library.Library("airserve", "FRAGMENT")
# kinds, activations: one per block segment, joined by ","; qs, d, m: the segments' fields.
_lib.define("packed_or_large(Tensor x, int max_rows, str kinds, str activations, Tensor[] qs, "
            "Tensor?[] d, Tensor?[] m, str path, int handle, Tensor? weight) -> Tensor")


# The same for a layer of one block segment, the common case (~120 calls a decode step of the
# default model), with its names passed as codes: indices into KINDS, ACTIVATIONS and
# LARGE_PATHS (the C++ operator holds the same tables; `airserve_codes::packed_or_large_names`
# lists them). A schema of tensors and ints only is one inductor's C++ wrapper calls through
# its light dispatcher bridge (aoti_torch_call_dispatcher); with str arguments it builds an
# IValue stack and three std::strings per call instead, and that code made the wrapper of the
# default model's decode graph take ~25 of its ~80 s compile on a 2-core AMD EPYC (g++ -O1).
_lib.define("packed_or_large_1(Tensor x, int max_rows, int kind, int activations, Tensor qs, "
            "Tensor? d, Tensor? m, int path, int handle, Tensor? weight) -> Tensor")
ACTIVATIONS = ("float32", "int8", "int16")
LARGE_PATHS = ("sgemm", "onednn", "bf16", "int8", "fp16", "int8_blocks")


@torch.library.register_fake("airserve::packed_or_large_1")
def _packed_or_large_1_fake(x, max_rows, kind, activations, qs, d, m, path, handle, weight):
    return x.new_empty(x.shape[0], qs.shape[0])


@torch.library.register_fake("airserve::packed_or_large")
def _packed_or_large_fake(x, max_rows, kinds, activations, qs, d, m, path, handle, weight):
    return x.new_empty(x.shape[0], sum(q.shape[0] for q in qs))


def large_path_args(layer: Linear, decode: bool = False
                    ) -> tuple[str, int, torch.Tensor | None] | None:
    """The large path of `layer` as the operator takes it (path, handle, weight), or None if it
    cannot: a layer whose large path dequantizes its blocks a chunk at a time. Decode rows of a
    layer with `large_int8` take int8_blocks (its weight a tensor the graph passes)."""
    if decode and layer.large_int8:
        return "int8_blocks", -1, layer.weight_int8_blocks
    if layer.large_path == "bfloat16":
        return "bf16", layer.weight_bf16.handle, None
    if layer.large_path in INT8_PATHS:
        return "int8", layer.weight_int8.handle, None
    if layer.large_path == "float16_weights":
        return "fp16", layer.weight_fp16.handle, None
    if layer.weight_onednn is not None:
        return "onednn", layer.weight_onednn.handle, None
    if layer.weight is not None:
        return "sgemm", -1, layer.weight
    return None


def packed_or_large(layer: Linear, x: torch.Tensor, decode: bool) -> torch.Tensor | None:
    """x @ w.T (+ bias) in a compiled graph, on the path `layer.path_for(rows, decode)` names, or
    None where the operator cannot express it (a large path that dequantizes the blocks a chunk
    at a time): the caller then decides at trace time (a guard on the size)."""
    # Runs while dynamo traces (which cannot trace a logging call): the graph runner's report
    # counts the graphs such layers add (`graphs_compiled`).
    large = large_path_args(layer, decode)
    if large is None:
        return None
    # Extend rows under a bf16 or int8 large path take it whatever their count (path_for).
    max_rows = layer.packed_max_rows if decode or layer.packed_for_extends else 0
    if len(layer.packed_kinds) == 1:
        kind = layer.packed_kinds[0]
        path, handle, weight = large
        out = torch.ops.airserve.packed_or_large_1(
            x.contiguous(), max_rows, KINDS.index(kind),
            ACTIVATIONS.index(layer.activations_for(kind, decode)), *layer._segment(0),
            LARGE_PATHS.index(path), handle, weight)
        return out if layer.bias is None else out + layer.bias
    segments = [layer._segment(i) for i in range(len(layer.packed_kinds))]
    out = torch.ops.airserve.packed_or_large(
        x.contiguous(), max_rows, ",".join(layer.packed_kinds),
        ",".join(layer.activations_for(kind, decode) for kind in layer.packed_kinds),
        [s[0] for s in segments], [s[1] for s in segments], [s[2] for s in segments], *large)
    return out if layer.bias is None else out + layer.bias
