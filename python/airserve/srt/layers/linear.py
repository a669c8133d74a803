"""The linear layer of the models: nn.Linear, plus an optional block-quantized copy of its weight
that small batches (decode) multiply with directly."""

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

# A layer without a float weight multiplies large batches with its weight dequantized in chunks
# of about this many values (16 MiB of float32) at a time.
DEQUANT_CHUNK_VALUES = 1 << 22


class Linear(nn.Linear):
    packed_max_rows: int = 0  # inputs of at most this many rows use the packed weight
    packed_kind: str = ""
    packed_activations: str = "float32"  # or "int8": see block_matvec.block_matmul

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

    def weight_bytes(self, rows: int) -> int:
        """Bytes of weight a product with `rows` input rows reads (blocks or float32)."""
        packed = self.packed
        if packed is not None and (rows <= self.packed_max_rows or self.weight is None):
            return packed.nbytes
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The row count is static inside a captured graph, so this branch is decided at capture.
        if 0 < x.shape[0] <= self.packed_max_rows and x.dim() == 2:
            out = block_matmul(x.contiguous(), self.packed_kind, self.packed_qs, self.packed_d,
                               self.packed_m, self.packed_activations)
            return out if self.bias is None else out + self.bias
        if self.weight is None:
            return self._dequantized_linear(x)
        return F.linear(x, self.weight, self.bias)

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


def packed_report(layers: list[Linear]) -> dict:
    """What /get_server_info's decode_kernels adds about the packed products of `layers`: the
    activations they use, the instruction set of each, and how many hold no float32 weight."""
    from airserve.srt.layers.quant.block_matvec import float32_isa, int8_isa

    packed = [m for m in layers if m.packed_kind and m.packed_max_rows]
    activations = sorted({m.packed_activations for m in packed})
    report = {"cpu_decode_activations": activations[0] if len(activations) == 1 else activations,
              "blocks_only_layers": sum(m.weight is None for m in packed)}
    if "int8" in activations:
        report["int8_isa"] = int8_isa()
    if "float32" in activations:
        report["float32_isa"] = float32_isa()
    return report
