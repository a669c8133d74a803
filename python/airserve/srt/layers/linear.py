"""The linear layer of the models: nn.Linear, plus an optional block-quantized copy of its weight
that small batches (decode) multiply with directly, and the weight form of the path larger inputs
use (`quant.matmul_paths`: float32, bfloat16 or w8a8_int8). `Linear.path_for(rows)` is the one
place that decides which product an input of `rows` rows takes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from airserve.srt.layers.quant.block_matvec import (
    ACTIVATIONS,
    MAX_ROWS,
    PackedWeight,
    block_matmul,
)
from airserve.srt.layers.quant.matmul_paths import PATHS, Int8Weight, pack_int8, w8a8_linear

# A layer without a float weight multiplies large batches with its weight dequantized in chunks
# of about this many values (16 MiB of float32) at a time.
DEQUANT_CHUNK_VALUES = 1 << 22


class Linear(nn.Linear):
    packed_max_rows: int = 0  # inputs of at most this many rows use the packed weight
    packed_kind: str = ""
    packed_activations: str = "float32"  # or "int8": see block_matvec.block_matmul
    large_path: str = "float32"  # inputs above packed_max_rows: one of matmul_paths.PATHS
    weight_int8: Int8Weight | None = None  # w8a8_int8's packed weight
    # bfloat16's weight [N, K] is the buffer weight_bf16 (set by set_large_path).

    def attach_packed(self, packed: PackedWeight, max_rows: int, activations: str = "float32",
                      drop_weight: bool = False) -> None:
        """Keep `packed` (the same values as `self.weight`) for inputs of <= max_rows rows;
        max_rows 0 keeps the blocks for other users (OpenVINO graphs) and multiplies with the
        float weight. `drop_weight` frees the float weight: larger inputs then multiply with the
        blocks dequantized a chunk of output rows at a time."""
        if tuple(packed.shape) != (self.out_features, self.in_features):
            raise ValueError(f"packed weight {packed.shape} does not match "
                             f"{(self.out_features, self.in_features)}")
        if not 0 <= max_rows <= MAX_ROWS:
            raise ValueError(f"max_rows={max_rows}: must be in 0..{MAX_ROWS}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations={activations!r}: must be one of {ACTIVATIONS}")
        if drop_weight and not max_rows:
            raise ValueError("drop_weight needs max_rows > 0 (the packed kernels)")
        self.register_buffer("packed_qs", packed.qs, persistent=False)
        self.register_buffer("packed_d", packed.d, persistent=False)
        self.register_buffer("packed_m", packed.m, persistent=False)
        self.packed_kind = packed.kind
        self.packed_max_rows = max_rows
        self.packed_activations = activations
        if drop_weight:
            self.register_parameter("weight", None)

    @property
    def packed(self) -> PackedWeight | None:
        if not self.packed_kind:
            return None
        return PackedWeight(self.packed_kind, self.packed_qs, self.packed_d, self.packed_m)

    def set_large_path(self, path: str, keep_float: bool = False) -> None:
        """Make inputs above the packed limit multiply through `path` (matmul_paths.PATHS),
        building its weight form from the float32 weight (or the blocks). The float32 weight is
        freed unless the path is float32 or `keep_float` (a weight shared with an embedding)."""
        if path not in PATHS:
            raise ValueError(f"matmul path {path!r}: choose one of {', '.join(PATHS)}")
        if path != "float32" and _has_no_weight(self.weight, self.packed_kind):
            raise ValueError("a path other than float32 needs the weight or its GGUF blocks")
        self.register_buffer("weight_bf16", self.float_weight().bfloat16()
                             if path == "bfloat16" else None, persistent=False)
        self.weight_int8 = pack_int8(self.float_weight()) if path == "w8a8_int8" else None
        self.large_path = path
        if path != "float32" and not keep_float and self.weight is not None:
            self.register_parameter("weight", None)

    def float_weight(self) -> torch.Tensor:
        """The float32 [N, K] weight: the parameter, or the blocks dequantized."""
        if self.weight is not None:
            return self.weight.float()
        return self.packed.dequantize()

    def path_for(self, rows: int) -> str:
        """The product an input of `rows` rows takes: "packed" or the large path."""
        return "packed" if 0 < rows <= self.packed_max_rows else self.large_path

    def weight_bytes(self, rows: int) -> int:
        """Bytes of weight a product with `rows` input rows reads."""
        path, packed = self.path_for(rows), self.packed
        if path == "packed" or (path == "float32" and self.weight is None):
            return packed.nbytes
        if path == "bfloat16":
            return self.weight_bf16.numel() * 2
        if path == "w8a8_int8":
            return self.weight_int8.nbytes
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        # The row count is static inside a captured graph, so the path is decided at capture.
        path = self.path_for(x.shape[0])
        if path == "packed":
            out = block_matmul(x.contiguous(), self.packed_kind, self.packed_qs, self.packed_d,
                               self.packed_m, self.packed_activations)
        elif path == "bfloat16":
            out = F.linear(x.to(torch.bfloat16), self.weight_bf16).to(x.dtype)
        elif path == "w8a8_int8":
            out = w8a8_linear(x.contiguous(), self.weight_int8.handle).to(x.dtype)
        elif self.weight is None:
            return self._dequantized_linear(x)
        else:
            return F.linear(x, self.weight, self.bias)
        return out if self.bias is None else out + self.bias

    def _dequantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T with the blocks dequantized `DEQUANT_CHUNK_VALUES` at a time (no float copy
        of the whole weight is ever held)."""
        step = max(1, DEQUANT_CHUNK_VALUES // self.in_features)
        outs = []
        for n0 in range(0, self.out_features, step):
            rows = slice(n0, n0 + step)
            w = torch.ops.airserve.dequantize_blocks(
                self.packed_kind, self.packed_qs[rows],
                None if self.packed_d is None else self.packed_d[rows],
                None if self.packed_m is None else self.packed_m[rows], self.in_features)
            outs.append(F.linear(x, w.to(x.dtype)))
        out = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return out if self.bias is None else out + self.bias


def _has_no_weight(weight: torch.Tensor | None, packed_kind: str) -> bool:
    """Whether a layer has neither a weight nor blocks to build another path's weight from."""
    return weight is None and not packed_kind


def packed_report(layers: list[Linear]) -> dict:
    """What /get_server_info's decode_kernels adds about the packed products of `layers`: the
    activations they use, the int8 instruction set, and how many hold no float32 weight."""
    from airserve.srt.layers.quant.block_matvec import int8_isa

    packed = [m for m in layers if m.packed_kind and m.packed_max_rows]
    activations = sorted({m.packed_activations for m in packed})
    report = {"cpu_decode_activations": activations[0] if len(activations) == 1 else activations,
              "blocks_only_layers": sum(m.weight is None for m in packed)}
    if "int8" in activations:
        report["int8_isa"] = int8_isa()
    return report


def matmul_path_report(layers: list[Linear]) -> list[dict]:
    """Which product each range of input rows (tokens in a forward pass) takes, for
    /get_server_info: [{"rows": "1-8", "path": "packed"}, {"rows": "9+", "path": ...}]."""
    limit = min((m.packed_max_rows for m in layers), default=0)
    large = sorted({m.large_path for m in layers})
    ranges = [{"rows": f"1-{limit}", "path": "packed"}] if limit else []
    ranges.append({"rows": f"{limit + 1}+", "path": large[0] if len(large) == 1 else large})
    return ranges
