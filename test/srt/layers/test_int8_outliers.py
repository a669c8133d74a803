"""The w8a8_int8_outliers matmul path (layers/quant/matmul_paths.py, int8_calibration.py):
int8 products with each layer's outlier input channels multiplied in float32. Against a float64
reference, the outlier channels' share exact to float32, the calibration finding an injected
outlier channel, the loader building the path, and its flags."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.layers.linear import Linear, matmul_path_report
from airserve.srt.layers.quant import int8_calibration, matmul_paths
from airserve.srt.layers.quant.matmul_paths import FIDELITY, choose_large_path
from airserve.srt.server_args import QUANTIZATIONS, ServerArgs

pytestmark = pytest.mark.skipif(not matmul_paths.int8_available(),
                                reason="torch has no fbgemm engine on this machine")

SHAPES = [(9, 64, 40), (33, 576, 192), (300, 96, 200)]  # (rows, K, N)
# Relative error (Frobenius norm) against float64 with 4 input channels 60x larger than the
# rest: the int8 part rounds w to 127 levels per output channel and x to 7 bits per row of the
# remaining channels (~2e-2, as w8a8_int8 on outlier-free Gaussian data); per-token w8a8_int8
# must size its 7-bit step by the outliers and does several times worse.
TOLERANCE = 4e-2


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def outlier_input(rows: int, k: int, channels: torch.Tensor) -> torch.Tensor:
    x = torch.randn(rows, k)
    x[:, channels] *= 60
    return x


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_outlier_path_against_float64(rows, k, n):
    torch.manual_seed(rows + k + n)
    channels = torch.randperm(k)[:4]
    w = torch.randn(n, k) * 0.05
    b = torch.randn(n) * 0.05
    layers = {}
    for path in ("w8a8_int8", "w8a8_int8_outliers"):
        layers[path] = Linear(k, n, bias=True)
        with torch.no_grad():
            layers[path].weight.copy_(w)
            layers[path].bias.copy_(b)
        layers[path].set_large_path(path, outliers=channels)
    x = outlier_input(rows, k, channels)
    ref = x.double() @ w.double().T + b.double()
    err = {path: relative_error(layer(x), ref) for path, layer in layers.items()}
    assert 1e-6 < err["w8a8_int8_outliers"] < TOLERANCE, err
    assert err["w8a8_int8"] > 3 * err["w8a8_int8_outliers"], err  # per-token int8 alone
    assert layers["w8a8_int8_outliers"].weight is None  # no float32 copy of the whole weight


def test_outlier_channels_are_multiplied_in_float32():
    """An input that is zero outside the outlier channels gives x @ w.T to float32 precision:
    were those channels quantized to int8 (7-bit activations, 8-bit weights) the error would be
    ~1e-2."""
    torch.manual_seed(0)
    k, n, channels = 128, 64, torch.tensor([3, 50, 99])
    w = torch.randn(n, k)
    layer = Linear(k, n, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    layer.set_large_path("w8a8_int8_outliers", outliers=channels)
    assert layer.weight_int8.outliers.tolist() == channels.tolist()
    x = torch.zeros(16, k)
    x[:, channels] = torch.randn(16, 3) * 37.3
    assert relative_error(layer(x), x.double() @ w.double().T) < 1e-6
    # The rest still goes through int8 (inexact), the outliers do not move its scale.
    x2 = torch.randn(16, k)
    x2[:, channels] = 0
    assert 1e-4 < relative_error(layer(x2), x2.double() @ w.double().T) < 4e-2


def test_outlier_path_needs_channels_and_checks_them():
    layer = Linear(32, 16, bias=False)
    with pytest.raises(ValueError, match="outlier input channels"):
        layer.set_large_path("w8a8_int8_outliers")
    with pytest.raises(ValueError, match="outside 0..31"):
        matmul_paths.pack_int8(torch.randn(16, 32), torch.tensor([1, 32]))


def test_calibration_finds_an_injected_outlier_channel(tmp_path):
    """A tiny model whose input norm weights have one channel 80x the rest: the calibration
    prefill must pick that channel for every layer the norms feed (q/k/v and gate/up)."""
    from airserve.srt.model_loader.loader import load_model
    from airserve.srt.tokenizer import get_tokenizer
    from airserve_testing.tiny_gguf import write_tiny_gguf

    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, "llama")
    _, model = load_model(path, "float32", "cpu")
    hot = 5
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[hot] *= 80
            layer.post_attention_layernorm.weight[hot] *= 80
    outliers = int8_calibration.find_outliers(model, get_tokenizer(path), 2)
    fed = [n for n in outliers if n.endswith(("qkv_proj", "gate_up_proj"))]
    assert fed and all(hot in outliers[n].tolist() for n in fed), outliers
    assert "lm_head" in outliers and all(len(v) == 2 for v in outliers.values())
    with pytest.raises(ValueError, match="must be >= 1"):
        int8_calibration.find_outliers(model, get_tokenizer(path), 0)


def test_loader_builds_the_path_and_reports_it(tmp_path):
    from airserve.srt.model_loader.loader import load_model
    from airserve_testing.tiny_gguf import write_tiny_gguf

    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, "llama")
    _, model = load_model(path, "float32", "cpu", large_path="w8a8_int8_outliers",
                          int8_outlier_channels=3)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.large_path == "w8a8_int8_outliers" and m.weight_int8.outliers.numel() == 3
               for m in layers)
    report = matmul_path_report(layers)
    assert report[-1]["path"] == "w8a8_int8_outliers"
    assert report[-1]["int8_outlier_channels"] == 3


def test_flags_and_auto_resolution():
    avx2_cpu, bf16_cpu = frozenset({"avx2", "fma"}), frozenset({"avx2", "avx512_bf16"})
    assert QUANTIZATIONS == matmul_paths.QUANTIZATIONS
    assert choose_large_path("auto", "w8a8_int8_outliers", avx2_cpu) == "w8a8_int8_outliers"
    assert choose_large_path("float32", "w8a8_int8", avx2_cpu) == "w8a8_int8"  # unchanged
    # auto on an AVX2 CPU: the first fbgemm path whose fidelity passed (float16 weights before
    # the int8 ones), float32 without fbgemm; float32 stays exact by flag.
    passed = [p for p in matmul_paths.FBGEMM_PATHS if FIDELITY[p]["passed"]]
    expected = passed[0] if passed and matmul_paths.fbgemm_cpu(avx2_cpu) else "float32"
    assert choose_large_path("auto", None, avx2_cpu) == expected
    assert choose_large_path("float32", None, avx2_cpu) == "float32"
    if matmul_paths.auto_eligible("bfloat16"):
        assert choose_large_path("auto", None, bf16_cpu) == "bfloat16"
    args = ServerArgs(quantization="w8a8_int8_outliers", int8_outlier_channels=8)
    assert args.resolved_large_path == "w8a8_int8_outliers"
    with pytest.raises(ValueError, match="int8_outlier_channels=0"):
        ServerArgs(quantization="w8a8_int8_outliers", int8_outlier_channels=0)
    with pytest.raises(ValueError, match="--quantization w8a8_int8_outliers"):
        ServerArgs(dtype="float32", int8_outlier_channels=8)


def test_full_range_activations_do_not_saturate():
    """The outlier path's 8-bit activations with 7-bit weights: rows of the largest u8 values
    against the largest weights, the worst case of AVX2's int16 pair sums, stay exact to the
    quantization (a saturated sum would be off by far more)."""
    k, n = 256, 32
    w = torch.ones(n, k)
    w[::2] = -1
    layer = Linear(k, n, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    layer.set_large_path("w8a8_int8_outliers", outliers=torch.tensor([0]))
    assert layer.weight_int8.weight_bits == 7
    x = torch.ones(12, k)
    x[::3] = -1
    assert relative_error(layer(x), x.double() @ w.double().T) < 1e-2


def test_graph_bucket_matches_eager_on_the_outlier_path(tmp_path):
    """A CPU graph runner bucket above the packed limit captures the outlier path (the opaque
    airserve::w8a8_linear, outlier channels inside) and matches eager on the same path."""
    from airserve_testing import random_prompts, run_side_by_side, tiny_gguf_runners

    graph, eager, _ = tiny_gguf_runners(str(tmp_path), (4,), 2, reference=dict(dtype="float32"),
                                        quantization="w8a8_int8_outliers",
                                        int8_outlier_channels=2)
    layers = [m for m in graph.model.modules() if isinstance(m, Linear)]
    assert all(m.path_for(4) == "w8a8_int8_outliers" for m in layers)
    assert graph.kernels_report()["matmul_paths"][-1]["int8_outlier_channels"] == 2
    replays = graph.graph_runner.replay_count
    prompts = random_prompts(graph.model_config.vocab_size, [5, 17, 9, 12])
    lg, le, tg, te, reqs = run_side_by_side(graph, eager, prompts, steps=4)
    assert graph.graph_runner.replay_count == replays + 4
    torch.testing.assert_close(lg, le, atol=1e-4, rtol=0)
    assert torch.equal(tg, te)
    for r in reqs:
        r.release()
