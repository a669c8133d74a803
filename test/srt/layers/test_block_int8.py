"""Packed products of every block kind, float32 and int8 activations, on every instruction set
this CPU has (AVX-512 VNNI, AVX-VNNI, AVX2, portable: `block_matvec.int8_isas()`).

References, in float64: float32 activations: x @ dequantize(w).T. int8 activations: the same
with x replaced by its per-block int8 quantization (airserve_testing.tiny_gguf's `int8_rows`:
scale max|x| / 127, round half to even), so the test checks the integer arithmetic, not the
quantization error.
`dequantize` itself is checked against the gguf package's numpy dequantization.
Tolerance: 2e-5 of the largest |output| (float32 scaling and summation over K / 32 blocks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from airserve.srt.layers.linear import Linear
from airserve.srt.layers.quant import block_matvec
from airserve.srt.layers.quant.block_matvec import KINDS, RAW_KINDS, packed_linear
from airserve.srt.model_loader.gguf_dequant import dequantize
from airserve_testing.compile_probe import compiled_calls
from airserve_testing.tiny_gguf import any_packed, int8_rows

TOL = 2e-5
# K per kind: not a multiple of 256 where the block size (32) allows it.
SIZES = {k: (96, 576) if RAW_KINDS.get(k, (32,))[0] == 32 else (256, 512) for k in KINDS}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not block_matvec.kernels_available():
        pytest.fail(f"the block kernels did not build: {block_matvec.unavailable_reason()}")
    yield
    block_matvec.use_int8_isa("auto")


def assert_near(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=TOL * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", range(1, 17))
def test_products_equal_the_dequantized_reference(kind: str, rows: int) -> None:
    for k in SIZES[kind]:
        w = any_packed(kind, 67, k, seed=rows)  # odd N: the last thread's chunk is partial
        wd = w.dequantize().double()
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        assert_near(packed_linear(x, w), x.double() @ wd.T)
        ref8 = int8_rows(x) @ wd.T
        for isa in block_matvec.int8_isas():
            assert block_matvec.use_int8_isa(isa) == isa
            assert_near(packed_linear(x, w, "int8"), ref8)
        block_matvec.use_int8_isa("auto")


@pytest.mark.parametrize("kind", sorted(RAW_KINDS))
def test_dequantize_equals_gguf_numpy(kind: str) -> None:
    k = SIZES[kind][0]
    w = any_packed(kind, 5, k)
    ref = dequantize(w.qs.numpy(), int(T[kind.upper()]), (5, k))
    np.testing.assert_array_equal(w.dequantize().numpy(), ref)


def test_int8_quantization_error_is_small() -> None:
    """int8 activations differ from float32 by about the int8 rounding of x (< 1%)."""
    w = any_packed("q4_k", 64, 512)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(3))
    f32, i8 = packed_linear(x, w), packed_linear(x, w, "int8")
    assert not torch.equal(f32, i8)
    assert ((i8 - f32).norm() / f32.norm()).item() < 0.01


def test_k_quants_need_k_a_multiple_of_256() -> None:
    w = any_packed("q4_k", 8, 512)
    for activations in ("float32", "int8"):
        with pytest.raises(RuntimeError, match="not a multiple of 256"):
            packed_linear(torch.randn(1, 288), w, activations)
    with pytest.raises(RuntimeError, match=r"raw blocks, uint8 \[N, 288\]"):
        packed_linear(torch.randn(1, 512), type(w)("q4_k", w.qs[:, :144].contiguous(), None, None))
    with pytest.raises(RuntimeError, match="unknown block kind 'q3_k'"):
        packed_linear(torch.randn(1, 512), type(w)("q3_k", w.qs, None, None), "int8")
    with pytest.raises(RuntimeError, match="1 to 16 rows"):
        packed_linear(torch.randn(17, 512), w, "int8")


def test_unknown_or_missing_instruction_set_is_refused() -> None:
    with pytest.raises(RuntimeError, match="unknown instruction set 'sse9'"):
        block_matvec.use_int8_isa("sse9")
    missing = [i for i in ("avx512_vnni", "avx_vnni", "avx2") if i not in block_matvec.int8_isas()]
    for isa in missing:
        with pytest.raises(RuntimeError, match=f"lacks {isa}"):
            block_matvec.use_int8_isa(isa)
    assert block_matvec.int8_isas()[-1] == "scalar"
    assert block_matvec.use_int8_isa("auto") == block_matvec.int8_isas()[0]


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_linear_without_float_weight(activations: str) -> None:
    """A blocks-only layer: small batches use the kernel, large ones dequantize in chunks."""
    from airserve.srt.layers import linear

    w = any_packed("q6_k", 40, 256)
    layer = Linear(256, 40, bias=True)
    ref_layer = Linear(256, 40, bias=True)
    with torch.no_grad():
        ref_layer.weight.copy_(w.dequantize())
        ref_layer.bias.copy_(layer.bias)
    layer.attach_packed(w, 4, activations, drop_weight=True)
    assert layer.weight is None and "weight" not in dict(layer.named_parameters())
    x = torch.randn(9, 256)
    old = linear.DEQUANT_CHUNK_VALUES
    linear.DEQUANT_CHUNK_VALUES = 256 * 16  # three chunks of output rows
    try:
        torch.testing.assert_close(layer(x), ref_layer(x), atol=1e-5, rtol=1e-5)
    finally:
        linear.DEQUANT_CHUNK_VALUES = old
    small, ref = layer(x[:3], decode=True), ref_layer(x[:3])  # decode rows: `activations`
    # int8: off by the activations' rounding, well under 1% of the output's norm.
    assert ((small - ref).norm() / ref.norm()).item() < (1e-6 if activations == "float32"
                                                          else 1e-2)
    assert layer.weight_bytes(9) == w.nbytes
    with pytest.raises(ValueError, match="drop_weight needs max_rows"):
        Linear(256, 40).attach_packed(w, 0, drop_weight=True)


def test_packed_report_names_activations_and_instruction_set() -> None:
    from airserve.srt.layers.linear import packed_report

    a, b = Linear(256, 8), Linear(256, 8)
    a.attach_packed(any_packed("q4_k", 8, 256), 4, "int8", drop_weight=True)
    b.attach_packed(any_packed("q8_0", 8, 256), 4, "int8")
    report = packed_report([a, b, Linear(256, 8)])
    # Extends multiply in float32 whatever the setting, so its instruction set is named too.
    assert report == {"cpu_decode_activations": "int8", "blocks_only_layers": 1,
                      "activations_rule": "decode rows: int8 for q4_k/q8_0; extend rows: float32",
                      "int8_isa": block_matvec.int8_isa(),
                      "float32_isa": block_matvec.float32_isa()}
    b.packed_activations = "float32"
    report = packed_report([a, b])
    assert report["cpu_decode_activations"] == ["float32", "int8"]
    assert report["float32_isa"] == block_matvec.float32_isa() == block_matvec.float32_isas()[0]


@pytest.mark.parametrize("kind", ["q4_1", "q6_k"])
def test_compiled_graph_calls_the_int8_kernel_in_place(kind: str) -> None:
    """Under torch.compile (fullgraph, inductor) the int8 product is one op of the graph."""
    layer = Linear(256, 40, bias=False)
    layer.attach_packed(any_packed(kind, 40, 256), 2, "int8", drop_weight=True)
    x = torch.randn(2, 256)
    seen, out = compiled_calls(layer, x, True)  # decode rows
    assert seen == [torch.ops.airserve.block_matmul_int8]
    torch.testing.assert_close(out, layer(x, decode=True))
    inductor = torch.compile(layer, fullgraph=True, dynamic=False)(x, True)
    torch.testing.assert_close(inductor, layer(x, decode=True))
    # Extend rows (decode=False) compile to the float32 product.
    seen, out = compiled_calls(layer, x)
    assert seen == [torch.ops.airserve.q4_1_matmul if kind == "q4_1"
                    else torch.ops.airserve.block_matmul_f32]
    assert torch.equal(out, layer(x))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q5_0", "q5_1"])
@pytest.mark.parametrize("k", [32, 64, 288, 1056])
def test_simd_int8_equals_portable_int8(kind: str, k: int) -> None:
    """The SIMD int8 products of Q4_1 / Q8_0 / Q5_0 / Q5_1 (column tiles, block pairs, an odd
    last block, the minimum or constant term 8 blocks at a time and a scalar tail) against the
    portable loop on every row count: same quantized activations, integer sums exact, float32
    order differs."""
    isas = [i for i in block_matvec.int8_isas() if i != "scalar"]
    if not isas:
        pytest.skip("this CPU has no SIMD int8 path")
    w = any_packed(kind, 37, k, seed=k)  # 37 columns: every tile width leaves a remainder
    for rows in range(1, 17):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k))
        block_matvec.use_int8_isa("scalar")
        ref = packed_linear(x, w, "int8").double()
        for isa in isas:
            block_matvec.use_int8_isa(isa)
            assert_near(packed_linear(x, w, "int8"), ref)
    block_matvec.use_int8_isa("auto")


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_q4_1_q8_0_int8_tiles_are_one_loop_on_every_simd_isa(kind: str) -> None:
    """Q4_1 / Q8_0 int8 products run the same column tiles on AVX2, AVX-VNNI and AVX-512 VNNI
    (only the integer dot product instruction differs, and integer sums are exact), so every
    SIMD instruction set gives the same bits, for every row count."""
    isas = [i for i in block_matvec.int8_isas() if i != "scalar"]
    if len(isas) < 2:
        pytest.skip("this CPU has fewer than two SIMD int8 paths")
    w = any_packed(kind, 37, 288, seed=3)
    try:
        for rows in range(1, 17):
            x = torch.randn(rows, 288, generator=torch.Generator().manual_seed(rows))
            outs = {}
            for isa in isas:
                block_matvec.use_int8_isa(isa)
                outs[isa] = packed_linear(x, w, "int8")
            for isa in isas[1:]:
                assert torch.equal(outs[isa], outs[isas[0]]), (rows, isa, isas[0])
    finally:
        block_matvec.use_int8_isa("auto")


def test_auto_prefers_avx_vnni_over_avx512_vnni() -> None:
    """Where the CPU has both, `auto` takes the AVX-VNNI build (measured faster on an Intel Xeon
    with both); a CPU with AVX-512 VNNI alone takes that."""
    isas = block_matvec.int8_isas()
    try:
        auto = block_matvec.use_int8_isa("auto")
    finally:
        block_matvec.use_int8_isa("auto")
    if "avx_vnni" in isas:
        assert auto == "avx_vnni"
    elif "avx512_vnni" in isas:
        assert auto == "avx512_vnni"
    else:
        pytest.skip("this CPU has no VNNI")


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q5_0", "q5_1"])
def test_int8_extremes_do_not_saturate(kind: str) -> None:
    """Largest weights times activations quantized to +-127 everywhere: the int16 pair sums of
    maddubs stay in range (a saturating path would be off by far more than the tolerance)."""
    w = any_packed(kind, 16, 256, seed=5)
    if kind == "q4_1":
        w.qs.fill_(0xFF)  # every nibble 15
    elif kind in ("q5_0", "q5_1"):  # every value 31: qh and qs all ones, the scales kept
        start = 2 if kind == "q5_0" else 4
        blocks = w.qs.view(16, -1, RAW_KINDS[kind][1])
        blocks[:, :, start:] = 0xFF
    else:
        w.qs.copy_(torch.where(torch.arange(w.qs.numel()).view_as(w.qs) % 2 == 0, -127, 127)
                   .to(torch.int8))
    wd = w.dequantize().double()
    sign = 1.0 if kind != "q8_0" else torch.where(wd > 0, 1.0, -1.0)[0].float()
    x = (torch.ones(3, 256) * sign * torch.tensor([[1.0], [-2.0], [3.0]])).contiguous()
    ref = int8_rows(x) @ wd.T
    for isa in block_matvec.int8_isas():
        block_matvec.use_int8_isa(isa)
        assert_near(packed_linear(x, w, "int8"), ref)
    block_matvec.use_int8_isa("auto")


def test_auto_activations_follow_the_fidelity_kinds() -> None:
    """activations "auto": int8 for the kinds that passed the fidelity check and are faster,
    int16 for those that passed in int16 (where it was measured faster), float32 (exact) for
    the others, in products, in a Linear of mixed segments and in the report."""
    from airserve.srt.layers.linear import packed_report

    assert block_matvec.AUTO_INT8_KINDS == {"q5_0"}
    assert block_matvec.AUTO_INT16_KINDS == {"q4_1", "q8_0", "q4_k", "q6_k"}
    for kind in KINDS:
        want = ("int8" if kind in block_matvec.AUTO_INT8_KINDS
                else "int16" if kind in block_matvec.AUTO_INT16_KINDS
                and block_matvec.int16_measured_here() else "float32")
        assert block_matvec.resolve_activations("auto", kind) == want
        assert block_matvec.resolve_activations("float32", kind) == "float32"
    with pytest.raises(ValueError, match="activations='int4'"):
        block_matvec.resolve_activations("int4", "q4_1")
    k_act = "int16" if block_matvec.int16_measured_here() else "float32"
    parts = [any_packed("q5_0", 16, 256, seed=1), any_packed("q4_k", 8, 256, seed=2),
             any_packed("q5_1", 8, 256, seed=3)]
    layer = Linear(256, 32, bias=False)
    layer.attach_packed(parts, 4, "auto", drop_weight=True)
    x = torch.randn(2, 256)
    expected = torch.cat([packed_linear(x, parts[0], "int8"), packed_linear(x, parts[1], k_act),
                          packed_linear(x, parts[2], "float32")], dim=-1)
    assert torch.equal(layer(x, decode=True), expected)
    assert not torch.equal(packed_linear(x, parts[0], "int8"), packed_linear(x, parts[0]))
    report = packed_report([layer])
    assert report["cpu_decode_activations"] == "auto"
    assert report["activations_by_kind"] == {"q5_0": "int8", "q4_k": k_act, "q5_1": "float32"}
    rule = ("decode rows: int8 for q5_0, int16 for q4_k, float32 for q5_1 (int16 up to "
            f"{block_matvec.INT16_MAX_ROWS} rows, float32 above); extend rows: float32"
            if k_act == "int16" else
            "decode rows: int8 for q5_0, float32 for q4_k, q5_1; extend rows: float32")
    assert report["activations_rule"] == rule
    assert report["int8_isa"] == block_matvec.int8_isa()
    assert report["float32_isa"] == block_matvec.float32_isa()


def test_auto_activations_follow_the_layer_role() -> None:
    """Q4_1 and Q8_0 take int8 under auto in the roles AUTO_INT8_ROLES names (the merged
    gate/up projection); elsewhere int16 (AUTO_INT16_KINDS, on CPUs where it was measured
    faster, else float32); the report names the kind by role."""
    from airserve.srt.layers.linear import packed_report

    assert block_matvec.AUTO_INT8_ROLES == {"q4_1": {"gate_up_proj"}, "q8_0": {"gate_up_proj"}}
    other = "int16" if block_matvec.int16_measured_here() else "float32"  # Q4_1 elsewhere
    for kind in ("q4_1", "q8_0"):
        assert block_matvec.resolve_activations("auto", kind, "gate_up_proj") == "int8"
        for role in ("", "qkv_proj", "o_proj", "down_proj", "lm_head"):
            assert block_matvec.resolve_activations("auto", kind, role) == other
    assert block_matvec.resolve_activations("auto", "q6_k", "gate_up_proj") == other
    assert block_matvec.resolve_activations("float32", "q4_1", "gate_up_proj") == "float32"
    w = any_packed("q4_1", 24, 256, seed=4)
    x = torch.randn(2, 256)
    layers = {}
    for role in ("gate_up_proj", "down_proj"):
        layer = Linear(256, 24, bias=False)
        layer.attach_packed(w, 4, "auto", drop_weight=True)
        layer.packed_role = role
        layers[role] = layer
    int8, exact = packed_linear(x, w, "int8"), packed_linear(x, w, "float32")
    int16 = packed_linear(x, w, "int16")
    assert not torch.equal(int8, exact) and not torch.equal(int16, exact)
    assert torch.equal(layers["gate_up_proj"](x, decode=True), int8)
    assert torch.equal(layers["down_proj"](x, decode=True), int16 if other == "int16" else exact)
    # Extend rows multiply in float32 whatever the role.
    assert torch.equal(layers["gate_up_proj"](x), exact)
    report = packed_report(list(layers.values()))
    assert report["activations_by_kind"] == {"q4_1:down_proj": other,
                                             "q4_1:gate_up_proj": "int8"}
    rows = (f" (int16 up to {block_matvec.INT16_MAX_ROWS} rows, float32 above)"
            if other == "int16" else "")
    assert report["activations_rule"] == (f"decode rows: int8 for q4_1:gate_up_proj, {other} "
                                          f"for q4_1:down_proj{rows}; extend rows: float32")
