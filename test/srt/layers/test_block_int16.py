"""Q4_1 and Q8_0 products with int16 activations (csrc/block_int16.cpp), AVX2 and portable.

Reference, in float64: each row of x quantized per block of 32 as the kernel does (scale
max|x| / 32767, round half to even), times the blocks' d * q, plus the exact x times m:
  out = sum_b (d_b * sum_j q_j * xq_j * xd_b + m_b * sum_j x_j).
So the test checks the integer arithmetic and the lane order, not the quantization error
(checked separately against the exact float32 product). Tolerance: 2e-5 of the largest
|output| (float32 scaling and summation over K / 32 blocks). Q8_0 the same without m, its
activations in their own order.
"""

from __future__ import annotations

import pytest
import torch

from airserve.srt.layers.linear import Linear, packed_report
from airserve.srt.layers.quant import block_matvec
from airserve.srt.layers.quant.block_matvec import PackedWeight, packed_linear
from airserve_testing.compile_probe import compiled_calls
from airserve_testing.tiny_gguf import any_packed

TOL = 2e-5
OPS = ("q4_1_matmul_i16", "q4_1_matmul_i16_portable")
Q8_0_OPS = ("q8_0_matmul_i16", "q8_0_matmul_i16_portable")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not block_matvec.kernels_available():
        pytest.fail(f"the block kernels did not build: {block_matvec.unavailable_reason()}")


def reference(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    b = x.view(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 32767 / amax, torch.zeros_like(amax))  # float32, as in C++
    xq = torch.round(b * inv).clamp(-32767, 32767).double() * (amax / 32767).double()
    n = w.qs.shape[0]
    dq = (w.values().double() * w.d.double().unsqueeze(-1)).reshape(n, -1)
    if w.m is None:  # q8_0
        return xq.view_as(x) @ dq.T
    mm = w.m.double().unsqueeze(-1).expand(n, -1, 32).reshape(n, -1)
    return xq.view_as(x) @ dq.T + x.double() @ mm.T


def run(op: str, x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    if op.startswith("q8_0"):
        return getattr(torch.ops.airserve, op)(x, w.qs, w.d)
    return getattr(torch.ops.airserve, op)(x, w.qs, w.d, w.m)


def assert_near(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=TOL * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", range(1, 17))
@pytest.mark.parametrize("k", [32, 96, 576, 1056])  # blocks per row: 1, 3, 18, 33 (not 8k)
def test_products_equal_the_int16_reference(kind: str, rows: int, k: int) -> None:
    w = any_packed(kind, 67, k, seed=rows)  # odd N: the last thread's chunk is partial
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k))
    ref = reference(x, w)
    outs = [run(op, x, w) for op in (OPS if kind == "q4_1" else Q8_0_OPS)]
    for out in outs:
        assert_near(out, ref)
    if rows <= block_matvec.INT16_MAX_ROWS:  # above: float32 (test_block_int16.py)
        assert_near(packed_linear(x, w, "int16"), ref)
    # The activations' rounding is visible: the check above is not the float32 product's.
    assert not torch.equal(outs[0], packed_linear(x, w, "float32"))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_quantization_error_is_that_of_16_bits(kind: str) -> None:
    """Against the exact float32 product: off by ~1e-5 of the output's scale (int8 activations
    are ~1e-2 off on the same data)."""
    w = any_packed(kind, 256, 576, seed=3)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(3))
    exact = x.double() @ w.dequantize().double().T
    scale = exact.abs().max().item()
    err16 = (run(OPS[0] if kind == "q4_1" else Q8_0_OPS[0], x, w).double()
             - exact).abs().max().item() / scale
    err8 = (packed_linear(x, w, "int8").double() - exact).abs().max().item() / scale
    assert err16 < 2e-4
    assert err16 < err8 / 20


def test_largest_values_do_not_overflow() -> None:
    """Every nibble 15, the largest d, activations at +-32767 everywhere (the lanes holding
    256 * q sum to ~2^29): an overflowing int32 lane would be off by far more than TOL."""
    w = any_packed("q4_1", 16, 1056, seed=5)
    w.qs.fill_(0xFF)
    w.d.fill_(60000.0)
    x = (torch.ones(3, 1056) * torch.tensor([[1.0], [-2.0], [3.0]])).contiguous()
    ref = reference(x, w)
    for op in OPS:
        assert_near(run(op, x, w), ref)


def test_q8_0_largest_values_do_not_overflow() -> None:
    """Every value -128 (the int8 extreme), the largest d, activations at +-32767: each int32
    lane sums four products of 2^22, far from overflowing; a wrong sign extension or lane order
    would be off by far more than TOL."""
    w = any_packed("q8_0", 16, 1056, seed=5)
    w.qs.fill_(-128)
    w.d.fill_(60000.0)
    x = (torch.ones(3, 1056) * torch.tensor([[1.0], [-2.0], [3.0]])).contiguous()
    ref = reference(x, w)
    for op in Q8_0_OPS:
        assert_near(run(op, x, w), ref)


def test_zero_and_tiny_rows() -> None:
    w = any_packed("q4_1", 40, 96, seed=6)
    x = torch.zeros(2, 96)
    x[1, 40] = 1e-30  # one block with a tiny maximum, the others all zero
    for op in OPS:
        out = run(op, x, w)
        assert torch.isfinite(out).all()
        assert_near(out, reference(x, w))


@pytest.mark.parametrize("op", OPS)
def test_bad_inputs_are_refused(op: str) -> None:
    w = any_packed("q4_1", 8, 64, seed=7)
    f = getattr(torch.ops.airserve, op)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        f(torch.randn(17, 64), w.qs, w.d, w.m)
    with pytest.raises(RuntimeError, match="float32"):
        f(torch.randn(2, 64, dtype=torch.float64), w.qs, w.d, w.m)
    with pytest.raises(RuntimeError, match="qs must be contiguous uint8"):
        f(torch.randn(2, 96), w.qs, w.d, w.m)  # K does not match the blocks
    with pytest.raises(RuntimeError, match="d and m"):
        f(torch.randn(2, 64), w.qs, w.d.float(), w.m)


@pytest.mark.parametrize("op", Q8_0_OPS)
def test_q8_0_bad_inputs_are_refused(op: str) -> None:
    w = any_packed("q8_0", 8, 64, seed=7)
    f = getattr(torch.ops.airserve, op)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        f(torch.randn(17, 64), w.qs, w.d)
    with pytest.raises(RuntimeError, match="float32"):
        f(torch.randn(2, 64, dtype=torch.float64), w.qs, w.d)
    with pytest.raises(RuntimeError, match="qs must be contiguous int8"):
        f(torch.randn(2, 96), w.qs, w.d)  # K does not match the blocks
    with pytest.raises(RuntimeError, match="qs must be contiguous int8"):
        f(torch.randn(2, 64), w.qs.view(torch.uint8), w.d)
    with pytest.raises(RuntimeError, match="d must be"):
        f(torch.randn(2, 64), w.qs, w.d.float())


def test_int16_is_for_its_kinds_only() -> None:
    """"int16" asked of a kind without an int16 product multiplies in float32 (and says so in
    the report). The K-quants' int16 products: test_block_int16_k.py."""
    assert block_matvec.INT16_KINDS == {"q4_1", "q8_0", "q4_k", "q6_k"}
    for kind in block_matvec.KINDS:
        want = "int16" if kind in block_matvec.INT16_KINDS else "float32"
        assert block_matvec.resolve_activations("int16", kind) == want
        assert block_matvec.resolve_activations("int16", kind, "gate_up_proj") == want
    w = any_packed("q5_0", 24, 256, seed=8)
    x = torch.randn(2, 256)
    assert torch.equal(packed_linear(x, w, "int16"), packed_linear(x, w, "float32"))
    a, b = Linear(256, 24, bias=False), Linear(256, 24, bias=False)
    a.attach_packed(any_packed("q4_1", 24, 256, seed=9), 4, "int16", drop_weight=True)
    b.attach_packed(w, 4, "int16", drop_weight=True)
    report = packed_report([a, b])
    assert report["cpu_decode_activations"] == "int16"
    assert report["activations_by_kind"] == {"q4_1": "int16", "q5_0": "float32"}


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_k", "q6_k"])
def test_batches_above_the_row_limit_multiply_in_float32(kind: str) -> None:
    """int16 serves decode batches of up to INT16_MAX_ROWS rows (where it is faster); a larger
    batch takes the float32 product, in eager dispatch, in a Linear and in packed_or_large's C++
    (whose own limit must match)."""
    from airserve.srt.layers.quant.packed_or_large import packed_or_large

    limit = block_matvec.INT16_MAX_ROWS
    names = torch.ops.airserve_codes.packed_or_large_names("int16_max_rows")
    assert names == [str(limit)]
    k = 512
    w = any_packed(kind, 24, k, seed=12)
    layer = Linear(k, 24, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w.dequantize())
    layer.attach_packed(w, 8, "int16")
    g = torch.Generator().manual_seed(12)
    for rows in (1, limit, limit + 1, 8):
        x = torch.randn(rows, k, generator=g)
        i16 = (torch.ops.airserve.q4_1_matmul_i16(x, w.qs, w.d, w.m) if kind == "q4_1"
               else torch.ops.airserve.q8_0_matmul_i16(x, w.qs, w.d) if kind == "q8_0"
               else torch.ops.airserve.block_matmul_i16(x, kind, w.qs))
        want = i16 if rows <= limit else packed_linear(x, w, "float32")
        assert torch.equal(packed_linear(x, w, "int16"), want), rows
        assert torch.equal(layer(x, decode=True), want), rows
        assert torch.equal(packed_or_large(layer, x, True), want), rows
        assert not torch.equal(i16, packed_linear(x, w, "float32"))


def test_linear_uses_int16_for_decode_rows_only() -> None:
    w = any_packed("q4_1", 40, 256, seed=10)
    layer = Linear(256, 40, bias=False)
    layer.attach_packed(w, 4, "int16", drop_weight=True)
    x = torch.randn(3, 256)
    assert torch.equal(layer(x, decode=True), packed_linear(x, w, "int16"))
    assert torch.equal(layer(x), packed_linear(x, w, "float32"))  # extend rows: exact


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_compiled_graph_calls_the_int16_kernel(kind: str) -> None:
    """Under torch.compile (fullgraph) the int16 product is one op of the graph, equal to
    eager, and inductor's graph gives the same values."""
    layer = Linear(256, 40, bias=False)
    layer.attach_packed(any_packed(kind, 40, 256, seed=11), 2, "int16", drop_weight=True)
    x = torch.randn(2, 256)
    seen, out = compiled_calls(layer, x, True)
    assert seen == [getattr(torch.ops.airserve, f"{kind}_matmul_i16")]
    assert torch.equal(out, layer(x, decode=True))
    # Every test's new Linear is a recompile of the same code: a generous limit, as elsewhere.
    with torch._dynamo.config.patch(recompile_limit=256):
        inductor = torch.compile(layer, fullgraph=True, dynamic=False)(x, True)
    torch.testing.assert_close(inductor, layer(x, decode=True), rtol=0, atol=0)
