"""int8_blocks: a Q4_1 layer's decode batches above the packed limit, and its extend rows but
those whose logits are read, with int8 activations per block of 32 (csrc/block_int8_gemm.cpp).
Checked against a float64 reference of the same quantization on random shapes (AVX2 tiles and
the portable ones; every row remainder of the 3-row tiles), as the decode product's terms
summed in another order, inside Linear (the float rows of an extend on the large path) and
packed_or_large (eager and compiled), the loader's choice per layer (--cpu-large-activations),
the report and the refusals."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.layers.linear import Linear
from airserve.srt.layers.quant import block_matvec, matmul_paths
from airserve.srt.layers.quant.packed_or_large import packed_or_large
from airserve_testing.tiny_gguf import any_packed, int8_rows

# Relative to the largest |output|: float32 sums of exact integer block sums against float64.
TOL = 2e-6
LIMIT = 4


@pytest.fixture(autouse=True)
def _kernels():
    if not block_matvec.kernels_available():
        pytest.fail(f"the block kernels did not build: {block_matvec.unavailable_reason()}")


@pytest.fixture
def portable():
    """The portable tiles: the int8 products' instruction set narrowed to "scalar"."""
    torch.ops.airserve_isa.set_int8_isa("scalar")
    yield
    torch.ops.airserve_isa.set_int8_isa("auto")


def reference(x: torch.Tensor, w: block_matvec.PackedWeight) -> torch.Tensor:
    """float64: x quantized as the int8 products do it (int8_rows) times the exact weight."""
    return int8_rows(x) @ w.dequantize().double().T


def packed_pair(n: int, k: int, seed: int = 0):
    w = any_packed("q4_1", n, k, seed=seed)
    return w, matmul_paths.pack_int8_blocks(w.values(), w.d, w.m)


def close(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> bool:
    scale = float(want.abs().max()) or 1.0
    return float((got.double() - want.double()).abs().max()) <= tol * scale


@pytest.mark.parametrize("use_portable", [False, True])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (64, 576), (32, 1536)])
def test_matches_the_float64_reference(request, use_portable: bool, n: int, k: int) -> None:
    if use_portable:
        request.getfixturevalue("portable")
    w, blocks = packed_pair(n, k, seed=n + k)
    g = torch.Generator().manual_seed(k)
    for rows in (1, 2, 3, 4, 5, 7, 16, 65):
        x = torch.randn(rows, k, generator=g) * 3
        x[0, :7] *= 40  # a block with an outlier: the others keep their own scale
        got = torch.ops.airserve.gemm_int8_blocks(x, blocks)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert close(got, reference(x, w)), (n, k, rows)


def test_avx2_and_portable_tiles_agree(portable) -> None:
    w, blocks = packed_pair(64, 576, seed=3)
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(4))
    slow = torch.ops.airserve.gemm_int8_blocks(x, blocks)
    torch.ops.airserve_isa.set_int8_isa("auto")
    if torch.ops.airserve_isa.int8_isa() == "scalar":
        pytest.skip("no SIMD int8 products on this CPU")
    fast = torch.ops.airserve.gemm_int8_blocks(x, blocks)
    assert close(fast, slow)
    assert not torch.equal(x, torch.zeros_like(x)) and float(fast.abs().max()) > 0


def test_same_terms_as_the_decode_product() -> None:
    """Up to 16 rows, block_matmul_int8 computes the same block terms (same quantizer, exact
    integer sums): the two differ by float32 summation order only."""
    w, blocks = packed_pair(96, 576, seed=5)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(6))
    decode = torch.ops.airserve.block_matmul_int8(x, "q4_1", w.qs, w.d, w.m)
    assert close(torch.ops.airserve.gemm_int8_blocks(x, blocks), decode)
    exact = x.double() @ w.dequantize().double().T
    err = float((decode.double() - exact).abs().max())
    assert 0 < err < 0.02 * float(exact.abs().max())  # int8's rounding, not exact


def test_saturation_free_at_the_extremes() -> None:
    """Every value 15 and activations at +-127 in every quad: the int16 sums reach their
    largest (8 quads x 2 x 15 x 127 = 30480) without saturating."""
    n, k = 16, 64
    w = block_matvec.PackedWeight("q4_1", torch.full((n, k // 2), 0xFF, dtype=torch.uint8),
                                  torch.full((n, k // 32), 1.0, dtype=torch.float16),
                                  torch.zeros(n, k // 32, dtype=torch.float16))
    blocks = matmul_paths.pack_int8_blocks(w.values(), w.d, w.m)
    for sign in (1.0, -1.0):
        x = torch.full((3, k), sign)
        got = torch.ops.airserve.gemm_int8_blocks(x, blocks)
        assert torch.allclose(got, torch.full((3, n), sign * 15 * k)), sign


def test_zero_rows_and_empty_batches() -> None:
    w, blocks = packed_pair(32, 64)
    assert torch.equal(torch.ops.airserve.gemm_int8_blocks(torch.zeros(4, 64), blocks),
                       torch.zeros(4, 32))
    assert torch.ops.airserve.gemm_int8_blocks(torch.zeros(0, 64), blocks).shape == (0, 32)


def test_refuses_bad_inputs() -> None:
    w, blocks = packed_pair(32, 64)
    op = torch.ops.airserve.gemm_int8_blocks
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.zeros(2, 64, dtype=torch.float64), blocks)
    with pytest.raises(RuntimeError, match="K=96"):
        op(torch.zeros(2, 96), blocks)
    with pytest.raises(RuntimeError, match="pack_int8_blocks"):
        op(torch.zeros(2, 64), blocks[..., :320].contiguous())
    with pytest.raises(ValueError, match="multiple of 16"):
        matmul_paths.pack_int8_blocks(w.values()[:24], w.d[:24], w.m[:24])
    with pytest.raises(ValueError, match="4-bit"):
        matmul_paths.pack_int8_blocks(w.values() * 2, w.d, w.m)


def q4_1_layer(n: int = 96, k: int = 576, role: str = "gate_up_proj",
               activations: str = "auto") -> Linear:
    w = any_packed("q4_1", n, k, seed=7)
    lin = Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w.dequantize())
    lin.packed_role = role
    lin.attach_packed(w, LIMIT, activations)
    return lin


def test_linear_takes_it_for_decode_batches_above_the_limit_only() -> None:
    lin = q4_1_layer()
    w = lin.packed
    lin.set_large_path("float32")
    lin.set_large_int8(True)
    assert lin.weight_bytes(LIMIT + 1) == lin.weight_int8_blocks.numel()
    g = torch.Generator().manual_seed(8)
    for rows in (1, LIMIT, LIMIT + 1, 40):
        x = torch.randn(rows, 576, generator=g)
        decode = lin(x, decode=True)
        if rows <= LIMIT:  # the packed decode product
            act = lin.activations_for("q4_1", True)
            assert torch.equal(decode, block_matvec.packed_linear(x, w, act))
        else:
            assert lin.path_for(rows) == "int8_blocks"
            int8 = torch.ops.airserve.gemm_int8_blocks(x, lin.weight_int8_blocks)
            assert torch.equal(decode, int8)
        # Extend rows without float_rows keep the large path (float32 here) at every count.
        assert lin.path_for(rows, decode=False) != "int8_blocks"
        assert torch.allclose(lin(x), x @ lin.weight.T, rtol=1e-5, atol=1e-4)
    lin.set_large_int8(False)
    assert lin.path_for(LIMIT + 1) == "float32" and lin.weight_int8_blocks is None


def test_extend_rows_take_it_but_the_rows_whose_logits_are_read() -> None:
    lin = q4_1_layer()
    lin.set_large_path("float32")
    x = torch.randn(10, 576, generator=torch.Generator().manual_seed(10))
    float_rows = torch.tensor([3, 9])
    plain = lin(x, float_rows=float_rows)  # large_int8 off: every row on the large path
    assert torch.equal(plain, lin(x))
    lin.set_large_int8(True)
    out = lin(x, float_rows=float_rows)
    int8 = torch.ops.airserve.gemm_int8_blocks(x, lin.weight_int8_blocks)
    others = [i for i in range(10) if i not in (3, 9)]
    assert torch.equal(out[others], int8[others])
    assert torch.equal(out[float_rows], lin(x[float_rows]))  # float32, as without int8
    assert not torch.allclose(out[others], plain[others], rtol=0, atol=1e-6)
    # A row's int8 result does not depend on the other rows (chunking, batching).
    assert torch.equal(lin(x[:4], float_rows=torch.tensor([3]))[:3], out[:3])
    assert torch.equal(lin(x, float_rows=torch.tensor([], dtype=torch.long)), int8)
    assert torch.equal(lin(x), plain)  # no float_rows named: the large path for every row
    assert torch.equal(lin(x, decode=True, float_rows=float_rows), lin(x, decode=True))


def test_linear_refuses_other_blocks() -> None:
    w = any_packed("q8_0", 32, 64)
    lin = Linear(64, 32, bias=False)
    lin.attach_packed(w, LIMIT, "auto")
    with pytest.raises(ValueError, match="Q4_1"):
        lin.set_large_int8(True)
    with pytest.raises(ValueError, match="Q4_1"):
        Linear(64, 32).set_large_int8(True)


def test_which_layers_take_it() -> None:
    gate_up, down = q4_1_layer(role="gate_up_proj"), q4_1_layer(role="down_proj")
    o_proj = q4_1_layer(role="o_proj")
    # auto: the roles AUTO_LARGE_INT8_ROLES names (gate/up and down), beside float16_weights,
    # in decoder layers 3..26 of 30 (the first and last 30 // 8 keep the large path).
    assert matmul_paths.AUTO_LARGE_INT8_ROLES == {"gate_up_proj", "down_proj"}
    assert matmul_paths.AUTO_LARGE_INT8_EDGE_DIVISOR == 8
    middle = (3, 30)
    assert gate_up.takes_int8_blocks("auto", "float16_weights", *middle)
    assert down.takes_int8_blocks("auto", "float16_weights", 26, 30)
    for index in (0, 2, 27, 29, None):
        assert not gate_up.takes_int8_blocks("auto", "float16_weights", index, 30), index
    assert not gate_up.takes_int8_blocks("auto", "float16_weights")  # no place in a stack
    assert gate_up.takes_int8_blocks("auto", "float16_weights", 0, 7)  # 7 // 8 = 0: no ends
    assert not o_proj.takes_int8_blocks("auto", "float16_weights", *middle)
    assert not gate_up.takes_int8_blocks("auto", "bfloat16", *middle)
    assert not gate_up.takes_int8_blocks("auto", "float32", *middle)
    # int8: every Q4_1 layer, wherever it sits; float: none.
    assert o_proj.takes_int8_blocks("int8", "float32")
    assert gate_up.takes_int8_blocks("int8", "float16_weights", 0, 30)
    assert not gate_up.takes_int8_blocks("float", "float16_weights", *middle)
    w = any_packed("q8_0", 32, 64)
    q8 = Linear(64, 32, bias=False)
    q8.packed_role = "gate_up_proj"
    q8.attach_packed(w, LIMIT, "auto")
    assert not q8.takes_int8_blocks("int8", "float16_weights")
    assert not q4_1_layer(n=40).takes_int8_blocks("int8", "float32")  # 40 outputs: not tiles
    unpacked = q4_1_layer()
    unpacked.packed_max_rows = 0  # blocks kept for OpenVINO graphs only
    assert not unpacked.takes_int8_blocks("int8", "float16_weights")
    with pytest.raises(ValueError, match="cpu_large_activations"):
        gate_up.takes_int8_blocks("int4", "float16_weights")


def test_packed_or_large_calls_it_eager_and_compiled() -> None:
    lin = q4_1_layer()
    lin.set_large_path("float32")
    lin.set_large_int8(True)
    g = torch.Generator().manual_seed(9)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    step = torch.compile(lambda x: lin(x, True), backend=backend, dynamic=True, fullgraph=True)
    for rows in (2, LIMIT, LIMIT + 1, 20):
        x = torch.randn(rows, 576, generator=g)
        want = lin(x, True)
        assert torch.equal(packed_or_large(lin, x, True), want), rows
        assert torch.equal(packed_or_large(lin, x, False), lin(x)), rows
        assert torch.equal(step(x), want), rows
    assert len(graphs) == 1
    x = torch.randn(LIMIT + 3, 576, generator=g)
    big = torch.ops.airserve.gemm_int8_blocks(x, lin.weight_int8_blocks)
    assert torch.equal(step(x), big)
    inductor = torch.compile(lambda x: lin(x, True), dynamic=True, fullgraph=True)
    assert torch.equal(inductor(x), big)


def test_loader_gives_it_to_the_gate_up_and_down_layers() -> None:
    """The default model (30 decoder layers) under float16_weights: auto gives the gate/up and
    down projections of layers 3..26 int8_blocks for their large decode batches, int8 every
    Q4_1 layer, float none; every layer keeps its float16 weight for extends, and the report
    counts the int8 layers and names those auto left at the model's ends."""
    from airserve.srt.layers.linear import matmul_path_report, packed_report
    from airserve.srt.model_loader.loader import decoder_layer_index, load_model

    if not matmul_paths.int8_available():
        pytest.skip("float16_weights needs fbgemm (x86 with AVX2)")
    for setting, roles, stack in (("auto", {"gate_up_proj", "down_proj"}, range(3, 27)),
                                  ("float", set(), range(0)),
                                  ("int8", {"gate_up_proj", "down_proj", "o_proj", "qkv_proj"},
                                   range(30))):
        _, model = load_model(None, "float32", "cpu", packed_decode_max_bs=LIMIT,
                              decode_activations="auto", large_path="float16_weights",
                              large_activations=setting)
        layers = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
        int8 = {n for n, m in layers.items() if m.large_int8}
        assert {n.rsplit(".", 1)[-1] for n in int8} == roles, setting
        assert {decoder_layer_index(n) for n in int8} == set(stack), setting
        assert all(m.large_path == "float16_weights" and m.weight_fp16 is not None
                   for m in layers.values())
        report = matmul_path_report(list(layers.values()))
        assert report[-1]["path"] == "float16_weights"
        assert report[-1].get("int8_blocks_layers", 0) == len(stack) * len(roles), setting
        ends = "(12 of their layers, at the model's ends, excepted)"
        rule = packed_report(list(layers.values())).get("activations_rule", "")
        assert (ends in rule) == (setting == "auto"), rule


def test_report_names_the_int8_decode_batches() -> None:
    from airserve.srt.layers.linear import packed_report

    gate_up, down = q4_1_layer(role="gate_up_proj"), q4_1_layer(role="down_proj")
    before = packed_report([gate_up, down])["activations_rule"]
    assert before.endswith("; extend rows: float32")
    gate_up.set_large_int8(True)
    rule = packed_report([gate_up, down])["activations_rule"]
    assert rule == before.replace(
        "; extend rows: float32", "; decode batches above the packed limit: int8 for "
        "q4_1:gate_up_proj, float32 for the rest; extend rows: int8 for q4_1:gate_up_proj but "
        "the rows whose logits are read, float32 for the rest")
    # A gate/up layer left on the large path (auto does so at the model's ends) is named.
    held = packed_report([gate_up, q4_1_layer(role="gate_up_proj"), down])["activations_rule"]
    ends = " (1 of their layers, at the model's ends, excepted)"
    assert held == rule.replace("limit: int8 for q4_1:gate_up_proj,",
                                f"limit: int8 for q4_1:gate_up_proj{ends},").replace(
        "q4_1:gate_up_proj but", f"q4_1:gate_up_proj{ends} but")


def test_flag(capsys) -> None:
    from airserve.launch_server import parse_args
    from airserve.srt.server_args import ServerArgs

    assert parse_args([]).cpu_large_activations == "auto"
    args = parse_args(["--cpu-large-activations", "float"])
    assert args.cpu_large_activations == "float"
    with pytest.raises(SystemExit):
        parse_args(["--cpu-large-activations", "int4"])
    assert "--cpu-large-activations" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cpu_large_activations"):
        ServerArgs(cpu_large_activations="int4")
