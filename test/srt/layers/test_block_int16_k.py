"""Q4_K and Q6_K products with int16 activations (csrc/block_int16_k.cpp), AVX2 and portable.

Reference, in float64: each row of x quantized per block of 32 as the kernel does (scale
max|x| / 32767, round half to even), times the weight's dequantized values less their
per-block minimum term, plus the exact x times that term (Q4_K: -dmin * mn[j]; Q6_K has none):
  out = sum_b (sum_j (w_j - c_b) * xq_j * xd_b + c_b * sum_j x_j).
So the test checks the integer arithmetic, the unpacking and the lane order, not the
quantization error (checked separately against the exact product). Tolerance: 2e-5 of the
largest |output| (float32 scaling and summation over K / 32 blocks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from airserve.srt.layers.linear import Linear, packed_report
from airserve.srt.layers.quant import block_matvec
from airserve.srt.layers.quant.block_matvec import PackedWeight, packed_linear
from airserve_testing.compile_probe import compiled_calls
from airserve_testing.tiny_gguf import any_packed

TOL = 2e-5
OPS = ("block_matmul_i16", "block_matmul_i16_portable")
KINDS = ("q4_k", "q6_k")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not block_matvec.kernels_available():
        pytest.fail(f"the block kernels did not build: {block_matvec.unavailable_reason()}")
    yield
    # The compiled variants of Linear.forward made here would count against the recompile
    # limit of the next module's fullgraph compiles.
    torch._dynamo.reset()


def block_minimums(w: PackedWeight) -> torch.Tensor:
    """float64 [N, K / 32]: each block's additive term (Q4_K: -dmin * mn, from the 6-bit
    scales' layout in ggml's get_scale_min_k4; Q6_K: zero)."""
    n, k = w.shape
    if w.kind == "q6_k":
        return torch.zeros(n, k // 32, dtype=torch.float64)
    b = w.qs.numpy().reshape(n, k // 256, 144)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    s = b[..., 4:16].astype(np.int64)
    mn = np.empty(b.shape[:2] + (8,), dtype=np.int64)
    for j in range(8):
        mn[..., j] = s[..., j + 4] & 63 if j < 4 else (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)
    return torch.from_numpy((-dmin[..., None] * mn).reshape(n, -1))


def reference(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    b = x.view(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 32767 / amax, torch.zeros_like(amax))  # float32, as in C++
    xq = torch.round(b * inv).clamp(-32767, 32767).double() * (amax / 32767).double()
    n, k = w.shape
    c = block_minimums(w).unsqueeze(-1).expand(n, -1, 32).reshape(n, k)
    return xq.view_as(x) @ (w.dequantize().double() - c).T + x.double() @ c.T


def run(op: str, x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    return getattr(torch.ops.airserve, op)(x, w.kind, w.qs)


def assert_near(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=TOL * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", range(1, 17))
@pytest.mark.parametrize("k", [256, 768, 1536])  # super-blocks per row: 1, 3, 6
def test_products_equal_the_int16_reference(kind: str, rows: int, k: int) -> None:
    w = any_packed(kind, 67, k, seed=rows)  # odd N: the last thread's chunk is partial
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k))
    ref = reference(x, w)
    outs = [run(op, x, w) for op in OPS]
    for out in outs:
        assert_near(out, ref)
    if rows <= block_matvec.INT16_MAX_ROWS:  # above: float32 (test_block_int16.py)
        assert_near(packed_linear(x, w, "int16"), ref)
    # The activations' rounding is visible: the check above is not the float32 product's.
    assert not torch.equal(outs[0], packed_linear(x, w, "float32"))


@pytest.mark.parametrize("kind", KINDS)
def test_quantization_error_is_that_of_16_bits(kind: str) -> None:
    """Against the exact product: off by ~1e-5 of the output's scale, far under int8's."""
    w = any_packed(kind, 256, 1536, seed=3)
    x = torch.randn(4, 1536, generator=torch.Generator().manual_seed(3))
    exact = x.double() @ w.dequantize().double().T
    scale = exact.abs().max().item()
    err16 = (run(OPS[0], x, w).double() - exact).abs().max().item() / scale
    err8 = (packed_linear(x, w, "int8").double() - exact).abs().max().item() / scale
    assert err16 < 2e-4
    assert err16 < err8 / 20


def test_largest_values_do_not_overflow() -> None:
    """The widest terms each kind allows, activations at +-32767 everywhere: Q4_K every nibble
    15 under the largest scales; Q6_K every value 0 (q - 32 = -32) under scales of -128, whose
    block sums reach 2^32 in the portable loop's 64-bit sums (an int32 there overflowed, found
    by this test). An overflow would be off by far more than TOL."""
    x = (torch.ones(3, 768) * torch.tensor([[1.0], [-2.0], [3.0]])).contiguous()
    w4 = any_packed("q4_k", 16, 768, seed=5)
    blocks = w4.qs.view(16, 3, 144)
    blocks[..., 4:].fill_(0xFF)  # scales, minimums 63; values 15
    w6 = any_packed("q6_k", 16, 768, seed=5)
    blocks = w6.qs.view(16, 3, 210)
    blocks[..., :192].fill_(0)  # every q 0
    blocks[..., 192:208].fill_(0x80)  # every scale -128
    blocks[..., 208:210] = torch.tensor([0x00, 0x70], dtype=torch.uint8)  # d = 8192
    for w in (w4, w6):
        ref = reference(x, w)
        for op in OPS:
            assert_near(run(op, x, w), ref)


@pytest.mark.parametrize("kind", KINDS)
def test_zero_and_tiny_rows(kind: str) -> None:
    w = any_packed(kind, 40, 512, seed=6)
    x = torch.zeros(2, 512)
    x[1, 300] = 1e-30  # one block with a tiny maximum, the others all zero
    for op in OPS:
        out = run(op, x, w)
        assert torch.isfinite(out).all()
        assert_near(out, reference(x, w))


@pytest.mark.parametrize("op", OPS)
def test_bad_inputs_are_refused(op: str) -> None:
    w = any_packed("q6_k", 8, 512, seed=7)
    f = getattr(torch.ops.airserve, op)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        f(torch.randn(17, 512), "q6_k", w.qs)
    with pytest.raises(RuntimeError, match="float32"):
        f(torch.randn(2, 512, dtype=torch.float64), "q6_k", w.qs)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        f(torch.randn(2, 288), "q6_k", w.qs)
    with pytest.raises(RuntimeError, match="qs must be contiguous uint8"):
        f(torch.randn(2, 768), "q6_k", w.qs)  # K does not match the blocks
    with pytest.raises(RuntimeError, match="q4_k or q6_k"):
        f(torch.randn(2, 512), "q5_0", w.qs)


def test_auto_and_the_report_name_int16_for_k_quants() -> None:
    """"int16" runs these kinds in int16; "auto" does where int16 was measured faster."""
    for kind in KINDS:
        assert block_matvec.resolve_activations("int16", kind) == "int16"
        want = "int16" if block_matvec.int16_measured_here() else "float32"
        assert block_matvec.resolve_activations("auto", kind, "down_proj") == want
    layers = []
    for kind in KINDS:
        layer = Linear(512, 24, bias=False)
        layer.attach_packed(any_packed(kind, 24, 512, seed=8), 4, "int16", drop_weight=True)
        layers.append(layer)
    assert packed_report(layers)["activations_by_kind"] == {"q4_k": "int16", "q6_k": "int16"}


@pytest.mark.parametrize("kind", KINDS)
def test_linear_uses_int16_for_decode_rows_only(kind: str) -> None:
    w = any_packed(kind, 40, 512, seed=10)
    layer = Linear(512, 40, bias=False)
    layer.attach_packed(w, 4, "int16", drop_weight=True)
    x = torch.randn(3, 512)
    assert torch.equal(layer(x, decode=True), packed_linear(x, w, "int16"))
    assert torch.equal(layer(x), packed_linear(x, w, "float32"))  # extend rows: exact


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_graph_calls_the_int16_kernel(kind: str) -> None:
    """Under torch.compile (fullgraph) the int16 product is one op of the graph, equal to
    eager, and inductor's graph gives the same values."""
    layer = Linear(512, 40, bias=False)
    layer.attach_packed(any_packed(kind, 40, 512, seed=11), 2, "int16", drop_weight=True)
    x = torch.randn(2, 512)
    seen, out = compiled_calls(layer, x, True)
    assert seen == [torch.ops.airserve.block_matmul_i16]
    assert torch.equal(out, layer(x, decode=True))
    # Its own recompile allowance: Linear.forward's compiled variants add up over the test
    # session (compile_probe.compiled_calls says why).
    with torch._dynamo.config.patch(recompile_limit=256):
        inductor = torch.compile(layer, fullgraph=True, dynamic=False)(x, True)
    torch.testing.assert_close(inductor, layer(x, decode=True), rtol=0, atol=0)
