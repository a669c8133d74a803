"""The block-quantized decode kernels (float32 activations) and the Linear layer that uses them.

Reference: `PackedWeight.dequantize()` (checked against the GGUF loader's dequantization in
test/srt/model_loader/test_gguf.py) followed by a float32 matmul, or by a float64 one for every
instruction-set path (AVX-512, AVX2+FMA+F16C, plain C++) this CPU has. Tolerance: 1e-5 of the
output scale; the kernels see the same values and differ only in summation order (and in one
rounding less where the AVX2 path forms q4_1's d * q + m with an FMA for three or more rows; for
one or two rows it adds q4_1's m term from the block sums of x, as the AVX-512 path does).
"""

from __future__ import annotations

import pytest
import torch

from airserve.srt.hardware import host_cpu
from airserve.srt.layers.linear import Linear
from airserve.srt.layers.quant import block_matvec
from airserve.srt.layers.quant.block_matvec import (
    KINDS,
    MAX_ROWS,
    RAW_KINDS,
    PackedWeight,
    packed_linear,
)
from airserve_testing.compile_probe import compiled_calls
from airserve_testing.tiny_gguf import any_packed, random_packed

FLOAT32_ISAS = ("avx512", "avx2", "scalar")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not block_matvec.kernels_available():
        pytest.fail(f"the block kernels did not build: {block_matvec.unavailable_reason()}")
    yield
    block_matvec.use_float32_isa("auto")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("isa", FLOAT32_ISAS)
def test_every_path_equals_the_float64_reference(isa: str, kind: str) -> None:
    """Each instruction-set path by name, every kind, rows 1..16, K not a multiple of 256 where
    the block size (32) allows it; odd N, so the last thread's chunk is partial."""
    if isa not in block_matvec.float32_isas():
        pytest.skip(f"this CPU lacks {isa}")
    assert block_matvec.use_float32_isa(isa) == isa == block_matvec.float32_isa()
    try:
        for k in (96, 576) if RAW_KINDS.get(kind, (32,))[0] == 32 else (256, 512):
            w = any_packed(kind, 67, k, seed=k)
            wd = w.dequantize().double()
            for rows in range(1, MAX_ROWS + 1):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                ref = x.double() @ wd.T
                out = packed_linear(x, w)
                assert out.dtype == torch.float32 and out.shape == ref.shape
                torch.testing.assert_close(out.double(), ref, rtol=0,
                                           atol=1e-5 * ref.abs().max().item())
    finally:
        block_matvec.use_float32_isa("auto")


def test_the_best_path_the_cpu_has_is_used() -> None:
    """The path follows the CPU's flags: AVX-512 (F, BW, VL), else AVX2 with FMA and F16C."""
    flags = host_cpu()[1]
    avx2 = {"avx2", "fma", "f16c"} <= flags
    expected = ("avx512" if avx2 and {"avx512f", "avx512bw", "avx512vl"} <= flags
                else "avx2" if avx2 else "scalar")
    assert block_matvec.float32_isas()[0] == expected
    assert block_matvec.use_float32_isa("auto") == expected == block_matvec.float32_isa()
    assert block_matvec.float32_isas()[-1] == "scalar"
    with pytest.raises(RuntimeError, match="unknown instruction set 'sse9'"):
        block_matvec.use_float32_isa("sse9")
    for isa in set(FLOAT32_ISAS) - set(block_matvec.float32_isas()):
        with pytest.raises(RuntimeError, match=f"lacks {isa}"):
            block_matvec.use_float32_isa(isa)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("k", [32, 96, 576])
def test_kernel_equals_dequantized_matmul(kind: str, rows: int, k: int) -> None:
    w = random_packed(kind, 67, k)  # odd N: the last thread's chunk is partial
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    ref = x @ w.dequantize().T
    out = packed_linear(x, w)
    assert out.shape == (rows, 67)
    torch.testing.assert_close(out, ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


def test_q4_1_nibble_order_follows_ggml() -> None:
    """Byte j of a block holds value j (low nibble) and value j + 16 (high nibble)."""
    qs = torch.zeros(1, 16, dtype=torch.uint8)
    qs[0, 3] = 0x5 | (0x9 << 4)
    w = PackedWeight("q4_1", qs, torch.ones(1, 1, dtype=torch.half),
                     torch.zeros(1, 1, dtype=torch.half))
    x = torch.zeros(1, 32)
    x[0, 3], x[0, 19] = 1.0, 100.0
    assert packed_linear(x, w).item() == 5 + 9 * 100


def test_kernel_rejects_bad_inputs() -> None:
    w = random_packed("q4_1", 8, 64)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        packed_linear(torch.randn(MAX_ROWS + 1, 64), w)
    with pytest.raises(RuntimeError, match="float32"):
        packed_linear(torch.randn(1, 64, dtype=torch.float64), w)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        packed_linear(torch.randn(1, 48), random_packed("q8_0", 8, 48 + 16))
    with pytest.raises(RuntimeError, match=r"qs must be contiguous \[N, 32\]"):
        packed_linear(torch.randn(1, 64), PackedWeight("q4_1", w.qs[:, :16], w.d, w.m))


def make_linear(kind: str, bias: bool, max_rows: int) -> tuple[Linear, PackedWeight]:
    packed = random_packed(kind, 40, 64)
    layer = Linear(64, 40, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(packed.dequantize())
    layer.attach_packed(packed, max_rows)
    return layer, packed


@pytest.mark.parametrize("bias", [False, True])
def test_linear_uses_the_packed_weight_up_to_max_rows(bias: bool) -> None:
    layer, packed = make_linear("q4_1", bias, max_rows=4)
    x = torch.randn(6, 64)
    ref = layer(x)  # 6 rows: the float32 weight
    torch.testing.assert_close(layer(x[:4]), ref[:4], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        layer.weight.zero_()  # now only the packed path can give these values
    torch.testing.assert_close(layer(x[:4]), ref[:4], atol=1e-5, rtol=1e-5)
    zeros = layer(x)[:, :]
    expected = layer.bias.expand(6, -1) if bias else torch.zeros(6, 40)
    torch.testing.assert_close(zeros, expected)


def test_linear_rejects_a_packed_weight_of_another_shape() -> None:
    layer = Linear(64, 40, bias=False)
    with pytest.raises(ValueError, match="does not match"):
        layer.attach_packed(random_packed("q4_1", 41, 64), 4)
    with pytest.raises(ValueError, match="max_rows=17"):
        layer.attach_packed(random_packed("q4_1", 40, 64), 17)


def test_compiled_graph_calls_the_kernel_in_place() -> None:
    """Under torch.compile (fullgraph) the kernel is one node of the graph, not a break."""
    layer, packed = make_linear("q8_0", False, max_rows=2)
    x = torch.randn(2, 64)
    seen, out = compiled_calls(layer, x)
    # A layer that keeps a float weight picks packed or large per call (test_packed_or_large).
    assert seen == [torch.ops.airserve.packed_or_large_1]  # the whole layer, in one op
    torch.testing.assert_close(out, layer(x))
    # Without a float weight the path is decided at trace time: the packed kernel itself.
    packed_only = Linear(64, 40, bias=False)
    packed_only.attach_packed(packed, 2, drop_weight=True)
    seen, out = compiled_calls(packed_only, x)
    assert seen == [torch.ops.airserve.q8_0_matmul]
    torch.testing.assert_close(out, layer(x))
    # Every layer compiled in this process is a variant of Linear.forward's code: past dynamo's
    # default limit of 8 a fullgraph compile fails.
    with torch._dynamo.config.patch(recompile_limit=256):
        inductor = torch.compile(layer, fullgraph=True, dynamic=False)(x)
    torch.testing.assert_close(inductor, layer(x))
