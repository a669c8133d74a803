"""The MLP's gated activation: silu(gate) * up over a merged gate/up projection's output.

Where the large matmul path is bfloat16 its gate/up product stays bfloat16 and the C++ operator
`airserve::silu_and_mul` (csrc/activation.cpp) reads it once and writes the float32 product;
everywhere else (float32 products, compiled graphs, where inductor fuses the same arithmetic, or
without the C++ operators) plain torch ops compute it from float32. Both are float32 arithmetic
on the same values: the operator's exponential is a polynomial (relative error ~1e-7), so the
two agree to a few float32 ulps, not bit for bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from airserve.srt.layers import cpu_kernels

_lib = torch.library.Library("airserve", "FRAGMENT")
_lib.define("silu_and_mul(Tensor gate_up) -> Tensor")
# The same operator's plain C++ loop (any CPU): for tests against the vector one.
_lib.define("silu_and_mul_portable(Tensor gate_up) -> Tensor")
# bf16 gate_up -> (bf16 product, float32 rounding error at `channels`): what a bf16 down
# projection reads (silu_and_mul_product).
_lib.define("silu_and_mul_bf16(Tensor gate_up, Tensor? channels) -> (Tensor, Tensor)")


@torch.library.register_fake("airserve::silu_and_mul")
def _silu_and_mul_fake(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=torch.float32)


@torch.library.register_fake("airserve::silu_and_mul_bf16")
def _silu_and_mul_bf16_fake(gate_up: torch.Tensor, channels: torch.Tensor | None):
    n = gate_up.shape[1] // 2
    k = 0 if channels is None else channels.numel()
    return gate_up.new_empty(gate_up.shape[0], n), gate_up.new_empty(gate_up.shape[0], k,
                                                                     dtype=torch.float32)


def silu_and_mul_product(gate_up: torch.Tensor, down, decode: bool) -> torch.Tensor | None:
    """`down(silu_and_mul(gate_up, torch.float32), decode)` in two C++ calls, where gate_up is a
    bf16 product ([rows, 2N], eager) and `down` (a Linear) multiplies these rows by the bf16 path
    in C++: the activations go to down as bf16 with their rounding error at its residual
    channels (`airserve::silu_and_mul_bf16`), so the float32 [rows, N] product is neither written
    nor read back and cast (three passes over 3 MiB a layer in a 512-token prefill step of the
    default model). The same bits as the float32 route. None where it does not apply."""
    if (gate_up.dtype != torch.bfloat16 or gate_up.dim() != 2 or gate_up.device.type != "cpu"
            or not cpu_kernels.available()
            or not down.takes_bf16_input(gate_up.shape[0], decode)):  # eager only
        return None
    act, err = torch.ops.airserve.silu_and_mul_bf16(gate_up, down.weight_bf16.channels)
    return down.forward_bf16(act, err)


def silu_and_mul(gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """gate_up [..., 2N] -> [..., N] = silu(gate) * up in `out_dtype` (default: gate_up's), the
    dtype of the activations the next layer multiplies. A bf16 product under float32
    activations (CPU's bf16 matmul path) is widened; a float16 or bfloat16 model's product
    stays in its dtype (its down projection's weight is of that dtype)."""
    out_dtype = out_dtype or gate_up.dtype
    if (gate_up.dtype == torch.bfloat16 and out_dtype == torch.float32
            and gate_up.device.type == "cpu" and not torch.compiler.is_compiling()
            and cpu_kernels.available()):
        flat = gate_up.reshape(-1, gate_up.shape[-1])
        return torch.ops.airserve.silu_and_mul(flat).reshape(*gate_up.shape[:-1], -1)
    gate, up = gate_up.to(out_dtype).chunk(2, dim=-1)
    return F.silu(gate) * up
