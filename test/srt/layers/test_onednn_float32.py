"""The float32 path by oneDNN (--cpu-float32-matmul onednn; layers/quant/matmul_paths.py):
against a float64 reference, rows independent of the batch around them, the per-rows dispatch
of Linear, what it keeps in memory, inside a fullgraph compile, and how the flag resolves."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.hardware import host_cpu
from airserve.srt.layers.linear import Linear, matmul_path_report
from airserve.srt.layers.quant import block_matvec, matmul_paths
from airserve.srt.server_args import ServerArgs
from airserve_testing.compile_probe import compiled_calls
from airserve_testing.tiny_gguf import random_packed

pytestmark = pytest.mark.skipif(not matmul_paths.onednn_available(),
                                reason="torch has no oneDNN (mkldnn) on this machine")

# Relative error (Frobenius norm) against float64: float32 products summed in float32 in
# oneDNN's order, ~1e-7 per product on Gaussian data.
TOLERANCE = 1e-5
SHAPES = [(1, 64, 40), (9, 37, 53), (33, 576, 192), (64, 576, 960), (300, 96, 200)]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def ops_run(fn) -> set[str]:
    """Names of the airserve operators `fn` calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("airserve::")}


def onednn_layer(k: int, n: int, bias: bool = True, seed: int = 0) -> tuple[Linear, ...]:
    """A float32 layer moved to oneDNN, and its weight and bias in float64 from before."""
    torch.manual_seed(seed)
    layer = Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        if bias:
            layer.bias.normal_(0, 0.05)
    w = layer.weight.double().clone()
    b = layer.bias.double().clone() if bias else None
    layer.set_large_path("float32", float32_impl="onednn")
    return layer, w, b


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_onednn_against_float64(rows, k, n):
    layer, w, b = onednn_layer(k, n, seed=rows + k + n)
    assert layer.float32_impl == "onednn" and layer.weight is None  # no plain copy beside it
    x = torch.randn(rows, k)
    ops = ops_run(lambda: layer(x))
    assert "airserve::onednn_linear" in ops, ops
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    assert relative_error(out, x.double() @ w.T + b) < TOLERANCE
    # The reordered weight holds the same float32 values.
    assert torch.equal(layer.float_weight().double(), w)


def test_rows_do_not_depend_on_padding_or_odd_batches():
    """A graph bucket pads a batch with rows of zeros: the real rows' results stay float32
    products of their own (oneDNN may choose another kernel for another row count)."""
    layer, w, _ = onednn_layer(576, 192, bias=False)
    x = torch.randn(13, 576)
    padded = torch.cat([x, torch.zeros(3, 576)])
    ref = x.double() @ w.T
    for batch in (x, padded, x[:9], torch.cat([x, x, x[:1]])):
        out = layer(batch)[:min(len(batch), 13)]
        assert relative_error(out, ref[:len(out)]) < TOLERANCE
    assert layer(padded)[13:].abs().max().item() == 0.0
    with torch.no_grad():  # a strided (non-contiguous) input is multiplied as its values
        wide = torch.randn(13, 1152)
        assert relative_error(layer(wide[:, ::2]), wide[:, ::2].double() @ w.T) < TOLERANCE


def test_dispatch_per_rows_from_blocks_and_weight_bytes():
    """Up to packed_max_rows the GGUF blocks; above, oneDNN over the dequantized values."""
    if not block_matvec.kernels_available():
        pytest.fail(f"the block kernels did not build: {block_matvec.unavailable_reason()}")
    packed = random_packed("q4_1", 48, 64)
    layer = Linear(64, 48, bias=False)
    with torch.no_grad():
        layer.weight.copy_(packed.dequantize())
    layer.attach_packed(packed, 4)
    layer.set_large_path("float32", float32_impl="onednn")
    assert layer.weight is None and layer.float32_impl == "onednn"
    assert [layer.path_for(r) for r in (1, 4, 5, 64)] == ["packed"] * 2 + ["float32"] * 2
    w = packed.dequantize().double()
    small, large = torch.randn(4, 64), torch.randn(20, 64)
    assert "airserve::onednn_linear" not in ops_run(lambda: layer(small))
    assert "airserve::onednn_linear" in ops_run(lambda: layer(large))
    assert relative_error(layer(small), small.double() @ w.T) < TOLERANCE
    assert relative_error(layer(large), large.double() @ w.T) < TOLERANCE
    assert layer.weight_bytes(4) == packed.nbytes and layer.weight_bytes(5) == 64 * 48 * 4
    assert matmul_path_report([layer]) == [
        {"rows": "1-4", "path": "packed"},
        {"rows": "5+", "path": "float32", "float32_impl": {"onednn": 1}}]
    assert matmul_path_report([layer, Linear(64, 8)])[-1]["float32_impl"] == {
        "onednn": 1, "sgemm": 1}


def test_kept_float_is_reordered_beside_it_and_paths_switch_back():
    torch.manual_seed(0)
    tied = Linear(64, 32, bias=False)
    shared, w = tied.weight, tied.weight.detach().double().clone()
    tied.set_large_path("float32", keep_float=True, float32_impl="onednn")
    # A tied lm_head: the embedding keeps reading the same plain tensor; products above the
    # packed limit use the reordered copy.
    assert tied.float32_impl == "onednn" and tied.weight is shared
    x = torch.randn(7, 64)
    assert "airserve::onednn_linear" in ops_run(lambda: tied(x))
    assert relative_error(tied(x), x.double() @ w.T) < TOLERANCE
    layer, w, _ = onednn_layer(64, 32, bias=False)
    layer.set_large_path("bfloat16")  # built from the reordered weight, which then goes
    assert layer.weight_onednn is None and layer.weight is None
    assert relative_error(layer.weight_bf16.dense().double(), w) < 1e-2
    back, w, _ = onednn_layer(64, 32, bias=False)
    back.set_large_path("float32")
    assert back.float32_impl == "sgemm" and torch.equal(back.weight.double(), w)
    with pytest.raises(ValueError, match="onednn, sgemm"):
        back.set_large_path("float32", float32_impl="mkl")


def test_fullgraph_compile_calls_the_operator():
    layer, w, b = onednn_layer(96, 40)
    x = torch.randn(16, 96)
    seen, out = compiled_calls(layer, x)
    assert torch.ops.airserve.onednn_linear in seen, seen  # one opaque call, no graph break
    assert relative_error(out, x.double() @ w.T + b) < TOLERANCE


def test_flag_resolution():
    # --dtype auto takes the path matmul_paths.auto_path picks for this CPU; where that is not
    # float32 no layer multiplies in float32 and sgemm names the unused float32 path.
    auto = matmul_paths.choose_large_path("auto", None, host_cpu()[1])
    assert ServerArgs().resolved_large_path == auto
    assert ServerArgs().resolved_float32_matmul == ("onednn" if auto == "float32" else "sgemm")
    assert ServerArgs(dtype="float32").resolved_float32_matmul == "onednn"  # cpu, with oneDNN
    assert ServerArgs(dtype="float32",
                      cpu_float32_matmul="sgemm").resolved_float32_matmul == "sgemm"
    assert ServerArgs(dtype="float32",
                      cpu_float32_matmul="onednn").resolved_float32_matmul == "onednn"
    # OpenVINO graphs read the plain weights.
    ov = ServerArgs(enable_torch_compile=True, torch_compile_backend="openvino")
    assert ov.resolved_float32_matmul == "sgemm"
    with pytest.raises(ValueError, match="cpu_float32_matmul='mkl'"):
        ServerArgs(cpu_float32_matmul="mkl")


def test_onednn_refused_without_mkldnn(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert matmul_paths.choose_float32_impl("auto") == "sgemm"
    with pytest.raises(ValueError, match="--cpu-float32-matmul sgemm"):
        ServerArgs(cpu_float32_matmul="onednn")


def test_openvino_copy_gets_plain_weights_and_the_original_keeps_onednn():
    """OpenVINO's graphs cannot read a reordered weight: its copy of a model loaded for another
    runner multiplies with the plain weight again; the original is untouched."""
    from airserve.srt.layers.quant.openvino_linear import with_openvino_linears

    layer, w, b = onednn_layer(64, 32)
    model = torch.nn.Sequential(layer)
    clone, replaced = with_openvino_linears(model)
    assert replaced == 0 and clone[0] is not layer
    assert clone[0].float32_impl == "sgemm" and torch.equal(clone[0].weight.double(), w)
    assert layer.float32_impl == "onednn" and layer.weight is None
    x = torch.randn(5, 64)
    assert "airserve::onednn_linear" not in ops_run(lambda: clone(x))
    assert relative_error(clone(x), x.double() @ w.T + b) < TOLERANCE
    assert relative_error(layer(x), x.double() @ w.T + b) < TOLERANCE
