"""The linear layer of the models: nn.Linear, plus an optional block-quantized copy of its weight
that small batches (decode) multiply with directly, and the weight form of the path larger inputs
use (`quant.matmul_paths`: float32, bfloat16, float16_weights, w8a8_int8 or
w8a8_int8_outliers, or the layer's own int8_blocks; float32 by oneDNN over a reordered weight or
by sgemm over the plain one). `Linear.path_for(rows, decode)` decides which product an input of
`rows` rows takes (and `forward`'s `float_rows`, which rows of an extend stay off int8_blocks).

The packed products take the layer's `packed_activations` (int8 or float32) only for decode
rows (`forward(x, decode=True)`: one new token per sequence); extend rows (a prefill, a chunk, a
cached prompt's short tail, and every row of a mixed prefill + decode step, which share one
product) always multiply with float32 activations, the same arithmetic as the dequantized
float32 matmul that long extends take. Under a large path other than float32 (bf16, float16
weights or int8 products) a short extend takes that path too, whatever its row count. Either
way a prompt's first output token does not depend on how much of the prompt was cached or how
it was chunked. A Q4_1 layer may also take int8_blocks (`set_large_int8`) for its decode
batches above the packed limit and for the extend rows whose logits are not read (their K/V
only); the rows whose logits are read keep the large path (`forward`'s `float_rows`). Each
int8_blocks row is multiplied alone, so chunking a prompt does not change it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from airserve.srt.layers.quant.block_matvec import (
    ACTIVATIONS,
    MAX_ROWS,
    PackedWeight,
    block_matmul,
    int16_measured_here,
    resolve_activations,
)
from airserve.srt.layers.quant.matmul_paths import (
    AUTO_LARGE_INT8_ROLES,
    FLOAT32_IMPLS,
    INT8_PATHS,
    PATHS,
    Bf16Weight,
    Float32Weight,
    Fp16Weight,
    Int8Weight,
    auto_large_int8_layer,
    bf16_linear,
    check_large_activations,
    fp16_weight_linear,
    gemm_int8_blocks,
    onednn_linear,
    pack_bf16,
    pack_float32,
    pack_fp16,
    pack_int8,
    pack_int8_blocks,
    w8a8_linear,
)
from airserve.srt.layers.quant.packed_or_large import packed_or_large

# Weight forms a Linear holds outside its parameters and buffers (oneDNN-reordered, fbgemm-packed
# objects, reached by graphs through integer handles).
OPAQUE_WEIGHTS = ("weight_onednn", "weight_int8", "weight_bf16", "weight_fp16")

# A layer without a float weight multiplies large batches with its weight dequantized in chunks
# of about this many values (16 MiB of float32) at a time.
DEQUANT_CHUNK_VALUES = 1 << 22


class Linear(nn.Linear):
    """nn.Linear plus, optionally, its weight as GGML blocks. The blocks may come in segments of
    output rows of different kinds (a merged q/k/v whose v is stored with more bits): each
    segment is one product, their outputs side by side."""

    packed_max_rows: int = 0  # inputs of at most this many rows use the packed weight
    packed_kinds: tuple[str, ...] = ()  # block kind of each segment, in output-row order
    # Activations of the packed products for decode rows ("float32", "int8" or "auto": see
    # block_matvec.block_matmul); extend rows use float32 in the packed products.
    packed_activations: str = "float32"
    # The layer's role in its model (the last part of its module name, e.g. "gate_up_proj"):
    # "auto" activations may differ by role (block_matvec.AUTO_INT8_ROLES).
    packed_role: str = ""
    large_path: str = "float32"  # inputs above packed_max_rows: one of matmul_paths.PATHS
    weight_int8: Int8Weight | None = None  # w8a8_int8's packed weight
    weight_onednn: Float32Weight | None = None  # float32 by oneDNN: replaces `weight`
    weight_bf16: Bf16Weight | None = None  # bfloat16's weight (oneDNN-reordered bf16)
    weight_fp16: Fp16Weight | None = None  # float16_weights' weight (fbgemm-packed float16)
    # Decode batches above packed_max_rows, and extend rows but the `float_rows` the caller names,
    # multiply through int8_blocks (`set_large_int8`, its weight the buffer `weight_int8_blocks`)
    # instead of the large path.
    large_int8: bool = False

    def attach_packed(self, packed: PackedWeight | Sequence[PackedWeight], max_rows: int,
                      activations: str = "float32", drop_weight: bool = False) -> None:
        """Keep `packed` (the same values as `self.weight`; a list: its parts stacked along the
        output rows) for inputs of <= max_rows rows; max_rows 0 keeps the blocks for other users
        (OpenVINO graphs) and multiplies with the float weight. `drop_weight` frees the float
        weight: larger inputs then multiply with the blocks dequantized a chunk of output rows
        at a time."""
        parts = merge_runs([packed] if isinstance(packed, PackedWeight) else list(packed))
        shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        if shape != (self.out_features, self.in_features) or any(
                p.shape[1] != self.in_features for p in parts):
            raise ValueError(f"packed weight {shape} does not match "
                             f"{(self.out_features, self.in_features)}")
        if not 0 <= max_rows <= MAX_ROWS:
            raise ValueError(f"max_rows={max_rows}: must be in 0..{MAX_ROWS}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations={activations!r}: must be one of {ACTIVATIONS}")
        if drop_weight and not max_rows:
            raise ValueError("drop_weight needs max_rows > 0 (the packed kernels)")
        for i, part in enumerate(parts):
            for field in ("qs", "d", "m"):
                self.register_buffer(_buffer(field, i), getattr(part, field), persistent=False)
        self.packed_kinds = tuple(p.kind for p in parts)
        self.packed_max_rows = max_rows
        self.packed_activations = activations
        int16_measured_here()  # now, eagerly: a compiled graph cannot ask it (its docstring)
        if drop_weight:
            self.register_parameter("weight", None)

    @property
    def packed_kind(self) -> str:
        """The block kind ("" without blocks; kinds joined by "+" for mixed segments)."""
        return "+".join(self.packed_kinds)

    @property
    def packed_parts(self) -> list[PackedWeight]:
        """The block segments, in output-row order (empty without blocks)."""
        return [PackedWeight(kind, *self._segment(i)) for i, kind in enumerate(self.packed_kinds)]

    @property
    def packed(self) -> PackedWeight | None:
        """The blocks as one weight, when they are of one kind (else None)."""
        parts = self.packed_parts
        return parts[0] if len(parts) == 1 else None

    def _segment(self, i: int) -> tuple:
        return tuple(getattr(self, _buffer(field, i)) for field in ("qs", "d", "m"))

    def set_large_path(self, path: str, keep_float: bool = False,
                       float32_impl: str = "sgemm",
                       outliers: torch.Tensor | None = None,
                       fp16_prepacked: tuple | None = None) -> None:
        """Make inputs above the packed limit multiply through `path` (matmul_paths.PATHS),
        building its weight form from the float32 weight (or the blocks). The float32 weight is
        freed unless the path is float32 or `keep_float` (a weight shared with an embedding).
        float32 with `float32_impl` "onednn" reorders the float32 weight for oneDNN in its place,
        or beside it with `keep_float` (a tied lm_head: the embedding reads the plain weight, so
        the reordered copy costs one more weight, ~113 MiB on the default model, and buys its
        widest product: 64 x 576 x 49152 ran 59 ms by sgemm, 33 ms by oneDNN on a 2-core AMD
        EPYC, AVX2); a layer without a float weight (blocks only: they dequantize per chunk)
        stays on sgemm. w8a8_int8_outliers keeps the input channels `outliers` (from a
        calibration pass: quant.int8_calibration) in float32 beside the int8 product; bfloat16
        given `outliers` adds those channels' bf16 rounding error back in float32
        (matmul_paths.Bf16Weight). `fp16_prepacked`: `matmul_paths.prepack_fp16` of this
        layer's float weight, done beforehand (the loader packs layers on several threads)."""
        if path not in PATHS:
            raise ValueError(f"matmul path {path!r}: choose one of {', '.join(PATHS)}")
        if float32_impl not in FLOAT32_IMPLS:
            raise ValueError(f"float32_impl {float32_impl!r}: choose one of "
                             f"{', '.join(FLOAT32_IMPLS)}")
        if path != "float32" and not self.has_weight_source:
            raise ValueError("a path other than float32 needs the weight or its GGUF blocks")
        self.weight_bf16 = (pack_bf16(self.float_weight(), outliers)
                            if path == "bfloat16" else None)
        self.weight_fp16 = None
        if path == "float16_weights":
            self.weight_fp16 = (pack_fp16(prepacked=fp16_prepacked) if fp16_prepacked is not None
                                else pack_fp16(self.float_weight()))
        outlier_path = path == "w8a8_int8_outliers"
        if outlier_path and outliers is None:
            raise ValueError("w8a8_int8_outliers needs the layer's outlier input channels")
        self.weight_int8 = (pack_int8(self.float_weight(), outliers if outlier_path else None,
                                      7 if outlier_path else 8)
                            if path in INT8_PATHS else None)
        onednn = (path == "float32" and float32_impl == "onednn"
                  and self.float_source is not None)
        if onednn and self.weight_onednn is None:
            self.weight_onednn = pack_float32(self.weight)
        elif not onednn and self.weight_onednn is not None:
            if self.weight is None and (path == "float32" or keep_float):  # plain weight back
                self.weight = nn.Parameter(self.weight_onednn.dense(), requires_grad=False)
            self.weight_onednn = None
        self.large_path = path
        if (onednn or path != "float32") and not keep_float and self.weight is not None:
            self.register_parameter("weight", None)

    @property
    def float_source(self) -> torch.Tensor | Float32Weight | None:
        """The float32 weight in whichever form the layer holds it (None: blocks only)."""
        return self.weight if self.weight_onednn is None else self.weight_onednn

    @property
    def float32_impl(self) -> str:
        """How the float32 path multiplies: "onednn", "sgemm", or "dequantized" (blocks
        dequantized a chunk at a time, no float32 weight held)."""
        if self.weight_onednn is not None:
            return "onednn"
        return "sgemm" if self.weight is not None else "dequantized"

    @property
    def has_weight_source(self) -> bool:
        """Whether the layer holds a float weight or blocks to build another path's weight
        from."""
        return self.float_source is not None or bool(self.packed_kind)

    def float_weight(self) -> torch.Tensor:
        """The float32 [N, K] weight: the parameter, or the blocks dequantized."""
        if self.weight is not None:
            return self.weight.float()
        if self.weight_onednn is not None:
            return self.weight_onednn.dense()
        return torch.cat([p.dequantize() for p in self.packed_parts])

    def path_for(self, rows: int, decode: bool = True) -> str:
        """The product an input of `rows` rows takes: "packed" or the large path. Extend rows
        (`decode` False) take the packed product only where it computes what the large path
        does (float32); a bf16 or int8 large path takes them all, so that a prompt's last
        token is computed alike in a long prefill and in a short cached tail."""
        if not self.packed_for_extends and not decode:
            return self.large_path
        if 0 < rows <= self.packed_max_rows:
            return "packed"
        return "int8_blocks" if decode and self.large_int8 else self.large_path

    @property
    def packed_for_extends(self) -> bool:
        return self.large_path == "float32"

    def weight_bytes(self, rows: int) -> int:
        """Bytes of weight a product with `rows` input rows reads."""
        path = self.path_for(rows)
        if path == "float32" and self.weight_onednn is not None:
            return self.weight_onednn.nbytes
        if self.packed_kinds and (path == "packed" or (path == "float32" and self.weight is None)):
            return sum(p.nbytes for p in self.packed_parts)
        if path == "bfloat16":
            return self.weight_bf16.nbytes
        if path == "float16_weights":
            return self.weight_fp16.nbytes
        if path == "int8_blocks":
            return self.weight_int8_blocks.numel()
        if path in INT8_PATHS:
            return self.weight_int8.nbytes
        return self.weight.numel() * self.weight.element_size()

    def set_large_int8(self, on: bool = True) -> None:
        """Make decode batches above the packed limit, and extend rows but those whose logits
        are read (`forward`'s `float_rows`), multiply through int8_blocks (the Q4_1 blocks
        repacked, int8 activations per block of 32); or the large path again. The rows whose
        logits are read stay on the large path: int8 in every prefill row of the gate/up
        projections turned the default model's chat answer "The capital of France is Paris."
        into "L'Étoile, la Marseillaise, ..." (its first token), and the last row alone in
        float32 gave the answer back."""
        blocks = None
        if on:
            if not self.int8_blocks_shape:
                raise ValueError("int8_blocks multiplies Q4_1 blocks (Q4_0 files too) of a layer "
                                 "with a multiple of 16 outputs; this layer has "
                                 f"{self.packed_kind or 'no blocks'}, {self.out_features} outputs")
            packed = self.packed
            blocks = pack_int8_blocks(packed.values(), packed.d, packed.m)
        self.register_buffer("weight_int8_blocks", blocks, persistent=False)
        self.large_int8 = on

    @property
    def int8_blocks_shape(self) -> bool:
        """Whether int8_blocks can multiply this layer: Q4_1 blocks (Q4_0 files too) and a
        multiple of 16 outputs (the kernel's tiles)."""
        return self.packed_kinds == ("q4_1",) and self.out_features % 16 == 0

    def takes_int8_blocks(self, setting: str, model_path: str, layer_index: int | None = None,
                          n_layers: int = 0) -> bool:
        """Whether this layer takes int8_blocks (`set_large_int8`) under
        --cpu-large-activations `setting` (LARGE_ACTIVATIONS) when the model's large path
        is `model_path`: "int8" in every layer of Q4_1 blocks (Q4_0 files too) that has the
        packed kernels and a multiple of 16 outputs, "float" in none, "auto" in those of them
        whose role AUTO_LARGE_INT8_ROLES names (gate/up, down) beside float16_weights, the one
        path it was measured against, and whose decoder layer `layer_index` of `n_layers` is
        not at the model's ends (auto_large_int8_layer; path_choice says why)."""
        check_large_activations(setting)
        if setting == "float" or not self.int8_blocks_shape or not self.packed_max_rows:
            return False
        return setting == "int8" or (model_path == "float16_weights"
                                     and self.packed_role in AUTO_LARGE_INT8_ROLES
                                     and auto_large_int8_layer(layer_index, n_layers))

    def activations_for(self, kind: str, decode: bool) -> str:
        """The activations ("float32", "int8" or "int16") of the packed product of a `kind`
        segment: `packed_activations` for decode rows, float32 for extend rows."""
        if not decode:
            return "float32"
        return resolve_activations(self.packed_activations, kind, self.packed_role)

    def forward(self, x: torch.Tensor, decode: bool = False,
                keep_bf16: bool = False, float_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        """x: [..., in_features]. `decode`: x holds decode rows (a ForwardMode.DECODE pass),
        whose packed products use `packed_activations`; otherwise float32 activations. The
        output is float32, except that `keep_bf16` lets the bfloat16 path return its product
        unwidened (for a consumer that reads bf16, e.g. activation.silu_and_mul).
        `float_rows` (extends; int64 row indices): the rows whose logits the pass reads. Under
        `large_int8` the other rows of an extend multiply through int8_blocks and these through
        the large path; None keeps every extend row on the large path."""
        if x.dim() != 2:
            return self.forward(x.reshape(-1, x.shape[-1]), decode,
                                keep_bf16, float_rows).reshape(*x.shape[:-1], -1)
        if (float_rows is not None and not decode and self.large_int8
                and not torch.compiler.is_compiling()):
            return self._int8_extend(x.contiguous(), float_rows)
        # `decode` is static inside a compiled graph, the row count may not be (a graph shared
        # by batch sizes): there one operator picks the path per call, as path_for does.
        if self.packed_max_rows and torch.compiler.is_compiling():
            out = packed_or_large(self, x, decode)
            if out is not None:
                return out
        path = self.path_for(x.shape[0], decode)
        if path == "packed":
            x = x.contiguous()
            outs = [block_matmul(x, kind, *self._segment(i), self.activations_for(kind, decode))
                    for i, kind in enumerate(self.packed_kinds)]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        elif path == "bfloat16":
            out = bf16_linear(x.contiguous(), self.weight_bf16, keep_bf16)
        elif path in INT8_PATHS:
            out = w8a8_linear(x.contiguous(), self.weight_int8.handle).to(x.dtype)
        elif path == "float16_weights":
            out = fp16_weight_linear(x.contiguous(), self.weight_fp16).to(x.dtype)
        elif path == "int8_blocks":
            out = gemm_int8_blocks(x.contiguous(), self.weight_int8_blocks)
        elif self.weight_onednn is not None:
            out = onednn_linear(x.contiguous(), self.weight_onednn.handle)
        elif self.weight is None:
            return self._dequantized_linear(x)
        else:
            return F.linear(x, self.weight, self.bias)
        return out if self.bias is None else out + self.bias

    def _int8_extend(self, x: torch.Tensor, float_rows: torch.Tensor) -> torch.Tensor:
        """Extend rows through int8_blocks, `float_rows` through the large path (module
        docstring: the rows whose logits are read). Each int8_blocks row is multiplied alone
        (its own scales, its own sums), so a row's result does not depend on the others."""
        out = gemm_int8_blocks(x, self.weight_int8_blocks)
        if self.bias is not None:
            out += self.bias
        if float_rows.numel():
            out[float_rows] = Linear.forward(self, x[float_rows]).to(out.dtype)
        return out

    def takes_bf16_input(self, rows: int, decode: bool = False) -> bool:
        """Whether `forward_bf16` multiplies `rows` rows as `forward` would: they take the
        bfloat16 path, in C++, outside a compiled graph."""
        return (self.weight_bf16 is not None and self.weight_bf16.in_cpp
                and self.path_for(rows, decode) == "bfloat16"
                and not torch.compiler.is_compiling())

    def forward_bf16(self, xb: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
        """`forward(x)` for float32 activations x [rows, in_features] that arrive as their bf16
        rounding `xb` and `err`, x less that rounding at the weight's residual channels
        ([rows, k], k = 0 without): float32 [rows, out_features], the same bits (see
        `takes_bf16_input`)."""
        out = torch.ops.airserve.bf16_linear_from_bf16(xb, err, self.weight_bf16.handle)
        return out if self.bias is None else out + self.bias

    def _dequantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T with the blocks dequantized `DEQUANT_CHUNK_VALUES` at a time (no float copy
        of the whole weight is ever held)."""
        step = max(1, DEQUANT_CHUNK_VALUES // self.in_features)
        outs = []
        for i, kind in enumerate(self.packed_kinds):
            qs, d, m = self._segment(i)
            for n0 in range(0, qs.shape[0], step):
                rows = slice(n0, n0 + step)
                w = torch.ops.airserve.dequantize_blocks(
                    kind, qs[rows], None if d is None else d[rows],
                    None if m is None else m[rows], self.in_features)
                outs.append(F.linear(x, w.to(x.dtype)))
        out = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return out if self.bias is None else out + self.bias


def _buffer(field: str, segment: int) -> str:
    # Segment 0 keeps the names a single block weight has always had.
    return f"packed_{field}" if segment == 0 else f"packed_{field}_{segment}"


def merge_runs(parts: list[PackedWeight]) -> list[PackedWeight]:
    """Adjacent block weights of one kind stacked along the output rows: blocks lie along a
    row, so stacking rows is concatenating the block arrays."""
    runs: list[list[PackedWeight]] = []
    for part in parts:
        if runs and runs[-1][0].kind == part.kind:
            runs[-1].append(part)
        else:
            runs.append([part])

    def cat(ts):
        return None if ts[0] is None else torch.cat(ts)

    return [run[0] if len(run) == 1 else
            PackedWeight(run[0].kind, cat([p.qs for p in run]), cat([p.d for p in run]),
                         cat([p.m for p in run])) for run in runs]


def packed_report(layers: list[Linear]) -> dict:
    """What /get_server_info's decode_kernels adds about the packed products of `layers`: the
    activations they use (`activations_rule`: which for decode rows, which for extends), the
    instruction set of each, and how many hold no float32 weight."""
    from airserve.srt.layers.quant.block_matvec import float32_isa, int8_isa

    packed = [m for m in layers if m.packed_kinds and m.packed_max_rows]
    activations = sorted({m.packed_activations for m in packed})
    report = {"cpu_decode_activations": activations[0] if len(activations) == 1 else activations,
              "blocks_only_layers": sum(m.float_source is None for m in packed)}
    resolved = {(_activations_label(kind, m.packed_role),
                 resolve_activations(m.packed_activations, kind, m.packed_role))
                for m in packed for kind in m.packed_kinds}
    if {"auto", "int16"} & set(activations):  # what each kind's products use for decode rows
        report["activations_by_kind"] = {k: a for k, a in sorted(resolved)}
    if packed:
        labels = [{_activations_label(kind, m.packed_role) for kind in m.packed_kinds}
                  for m in packed]
        large_int8 = set().union(*(ls for m, ls in zip(packed, labels) if m.large_int8))
        # Layers of those kinds and roles left on the large path (auto: the model's ends).
        held_back = sum(not m.large_int8 and bool(ls & large_int8)
                        for m, ls in zip(packed, labels))
        report["activations_rule"] = activations_rule(resolved, large_int8, held_back)
    activations = {a for _, a in resolved} | ({"float32"} if packed else set())  # extends
    if "int8" in activations:
        report["int8_isa"] = int8_isa()
    if "float32" in activations:
        report["float32_isa"] = float32_isa()
    return report


def _activations_label(kind: str, role: str) -> str:
    """How the report names a kind's products: "q4_1:gate_up_proj" where auto decides the kind
    by role (block_matvec.AUTO_INT8_ROLES), else the kind."""
    from airserve.srt.layers.quant.block_matvec import AUTO_INT8_ROLES

    return f"{kind}:{role}" if role and kind in AUTO_INT8_ROLES else kind


def activations_rule(resolved: set[tuple[str, str]], large_int8: set[str] = frozenset(),
                     held_back: int = 0) -> str:
    """The rule in words, from (kind, decode activations) pairs and the kinds (labelled as in
    the pairs) whose layers multiply decode batches above the packed limit through
    int8_blocks, `held_back` layers of those kinds excepted (auto: at the model's ends), e.g.
    "decode rows: int8 for q4_1, float32 for q8_0; extend rows: float32"."""
    by_act: dict[str, list[str]] = {}
    for kind, act in sorted(resolved):
        by_act.setdefault(act, []).append(kind)
    decode = ", ".join(f"{act} for {'/'.join(kinds)}" for act, kinds in sorted(by_act.items(),
                       key=lambda item: item[0] != "int8"))
    if "int16" in by_act:
        from airserve.srt.layers.quant.block_matvec import INT16_MAX_ROWS

        decode += f" (int16 up to {INT16_MAX_ROWS} rows, float32 above)"
    if not large_int8:
        return f"decode rows: {decode}; extend rows: float32"
    int8 = "/".join(sorted(large_int8))  # int8_blocks: Linear.set_large_int8
    ends = f" ({held_back} of their layers, at the model's ends, excepted)" if held_back else ""
    return (f"decode rows: {decode}; decode batches above the packed limit: int8 for "
            f"{int8}{ends}, float32 for the rest; extend rows: int8 for {int8}{ends} but the "
            f"rows whose logits are read, float32 for the rest")


def matmul_path_report(layers: list[Linear], names: list[str] | None = None) -> list[dict]:
    """Which product each range of input rows (tokens in a forward pass) takes, for
    /get_server_info: [{"rows": "1-8", "path": "packed"}, {"rows": "9+", "path": ...}]. With
    the layers' module `names`, bfloat16 layers with residual channels are listed by kind
    ("bf16_residual_channels": {"down_proj": 16})."""
    limit = min((m.packed_max_rows for m in layers), default=0)
    large = sorted({m.large_path for m in layers})
    ranges = [{"rows": f"1-{limit}", "path": "packed"}] if limit else []
    if limit and any(not m.packed_for_extends for m in layers):
        ranges[0]["extend_rows"] = "large path"  # only decode rows take the packed products
    ranges.append({"rows": f"{limit + 1}+", "path": large[0] if len(large) == 1 else large})
    residual = [(n, m.weight_bf16.channels.numel())
                for n, m in zip(names or [""] * len(layers), layers)
                if m.large_path == "bfloat16" and m.weight_bf16.channels is not None]
    if residual:
        ranges[-1]["bf16_residual_channels"] = dict(sorted(
            {n.rsplit(".", 1)[-1] or "layers": k for n, k in residual}.items()))
    int8_layers = sum(m.large_int8 for m in layers)
    if int8_layers:  # these layers take int8_blocks for most of these rows (set_large_int8)
        ranges[-1]["int8_blocks_layers"] = int8_layers
    if "float32" in large:  # layers per float32 implementation (Linear.float32_impl)
        impls = Counter(m.float32_impl for m in layers if m.large_path == "float32")
        ranges[-1]["float32_impl"] = dict(sorted(impls.items()))
    if "w8a8_int8_outliers" in large:  # input channels per layer multiplied in float32
        counts = sorted({m.weight_int8.outliers.numel() for m in layers
                         if m.large_path == "w8a8_int8_outliers"})
        ranges[-1]["int8_outlier_channels"] = counts[0] if len(counts) == 1 else counts
    return ranges
