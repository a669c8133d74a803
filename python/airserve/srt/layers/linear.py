"""The linear layer of the models: nn.Linear, plus an optional block-quantized copy of its weight
that small batches (decode) multiply with directly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from airserve.srt.layers.quant.block_matvec import MAX_ROWS, PackedWeight, block_matmul


class Linear(nn.Linear):
    packed_max_rows: int = 0  # inputs of at most this many rows use the packed weight
    packed_kind: str = ""

    def attach_packed(self, packed: PackedWeight, max_rows: int) -> None:
        """Keep `packed` (the same values as `self.weight`) for inputs of <= max_rows rows;
        max_rows 0 keeps the blocks for other users (OpenVINO graphs) and multiplies with the
        float weight."""
        if tuple(packed.shape) != tuple(self.weight.shape):
            raise ValueError(f"packed weight {packed.shape} does not match "
                             f"{tuple(self.weight.shape)}")
        if not 0 <= max_rows <= MAX_ROWS:
            raise ValueError(f"max_rows={max_rows}: must be in 0..{MAX_ROWS}")
        self.register_buffer("packed_qs", packed.qs, persistent=False)
        self.register_buffer("packed_d", packed.d, persistent=False)
        self.register_buffer("packed_m", packed.m, persistent=False)
        self.packed_kind = packed.kind
        self.packed_max_rows = max_rows

    @property
    def packed(self) -> PackedWeight | None:
        if not self.packed_kind:
            return None
        return PackedWeight(self.packed_kind, self.packed_qs, self.packed_d, self.packed_m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The row count is static inside a captured graph, so this branch is decided at capture.
        if 0 < x.shape[0] <= self.packed_max_rows and x.dim() == 2:
            out = block_matmul(x.contiguous(), self.packed_kind, self.packed_qs, self.packed_d,
                               self.packed_m)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)
