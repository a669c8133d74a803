"""The matmul paths of prefill and large batches (layers/quant/matmul_paths.py): each path
against a float64 reference, the per-rows dispatch of Linear, what each path keeps in memory,
and how --dtype / --quantization / auto resolve on a CPU (and are refused where it lacks them).
"""

from __future__ import annotations

import pytest
import torch

from airserve.srt.hardware import host_cpu
from airserve.srt.layers import cpu_kernels
from airserve.srt.layers.linear import Linear, matmul_path_report
from airserve.srt.layers.quant import block_matvec, matmul_paths
from airserve.srt.layers.quant.matmul_paths import FIDELITY, choose_large_path
from airserve.srt.server_args import ServerArgs
from airserve_testing.tiny_gguf import random_packed

# Relative error (Frobenius norm) of x @ w.T + b against float64 on Gaussian x and w:
# float32 sums in float32 (~1e-7 per product); bfloat16 rounds x and w to 8 significant bits
# (~3e-3) and accumulates in float32; w8a8_int8 rounds w to 127 levels per output channel and
# x to 7 bits per tensor (fbgemm's reduce_range on AVX2), ~2e-2; float16_weights rounds w alone
# to 11 significant bits (~3e-4) and multiplies in float32.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16_weights": 2e-3, "w8a8_int8": 5e-2}
SHAPES = [(9, 64, 40), (33, 576, 192), (300, 96, 200)]  # (rows, K, N)
NEEDS_INT8 = pytest.mark.skipif(not matmul_paths.int8_available(),
                                reason="torch has no fbgemm engine on this machine")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("path", ["float32", "bfloat16",
                                  pytest.param("float16_weights", marks=NEEDS_INT8),
                                  pytest.param("w8a8_int8", marks=NEEDS_INT8)])
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_path_against_float64(path, rows, k, n):
    torch.manual_seed(rows + k + n)
    layer = Linear(k, n, bias=True)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        layer.bias.normal_(0, 0.05)
    w, b = layer.weight.double().clone(), layer.bias.double().clone()
    layer.set_large_path(path)
    x = torch.randn(rows, k)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    err = relative_error(out, x.double() @ w.T + b)
    assert err < TOLERANCE[path], err
    if path != "float32":
        assert err > 1e-6, "the path did not run (exact result)"
        assert layer.weight is None  # no float32 copy beside the path's weight


@NEEDS_INT8
@pytest.mark.parametrize("path", ["bfloat16", "float16_weights", "w8a8_int8"])
def test_dispatch_per_rows_and_weights_from_blocks(path):
    """Decode rows up to packed_max_rows: the blocks; above, the path, its weight built from the
    blocks. Extend rows take the path whatever their count (a cached prompt's short tail is
    computed as in a long prefill)."""
    if not block_matvec.kernels_available():
        pytest.fail(f"the block kernels did not build: {block_matvec.unavailable_reason()}")
    packed = random_packed("q4_1", 48, 64)
    layer = Linear(64, 48, bias=False)
    layer.attach_packed(packed, 4, drop_weight=True)
    layer.set_large_path(path)
    assert [layer.path_for(r) for r in (1, 4, 5, 64)] == ["packed"] * 2 + [path] * 2
    assert [layer.path_for(r, decode=False) for r in (1, 4, 64)] == [path] * 3
    w = packed.dequantize().double()
    small, large = torch.randn(4, 64), torch.randn(20, 64)
    assert relative_error(layer(small, decode=True), small.double() @ w.T) < 1e-5
    assert 1e-6 < relative_error(layer(large), large.double() @ w.T) < TOLERANCE[path]
    # A short extend equals its rows inside a long one: the same product.
    extend = layer(small)
    assert 1e-6 < relative_error(extend, small.double() @ w.T) < TOLERANCE[path]
    torch.testing.assert_close(extend, layer(torch.cat([small, large]))[:4], atol=1e-5, rtol=0)
    assert layer.weight_bytes(4) == packed.nbytes
    assert layer.weight_bytes(5) < 64 * 48 * 4 / 1.9  # bf16, float16 or int8, not float32
    report = matmul_path_report([layer])
    assert report == [{"rows": "1-4", "path": "packed", "extend_rows": "large path"},
                      {"rows": "5+", "path": path}]


def test_tied_weight_stays_and_unknown_path_is_refused():
    layer = Linear(64, 32, bias=False)
    layer.set_large_path("bfloat16", keep_float=True)
    assert layer.weight is not None and layer.weight_bf16.dense().dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float32, bfloat16"):
        layer.set_large_path("int4")


def test_resolution_per_cpu_flags():
    bf16_cpu, avx2_cpu = frozenset({"avx2", "avx512_bf16"}), frozenset({"avx2", "fma"})
    assert choose_large_path("float32", None, bf16_cpu) == "float32"
    assert choose_large_path("bfloat16", None, bf16_cpu) == "bfloat16"
    assert choose_large_path("bfloat16", None, frozenset({"amx_bf16"})) == "bfloat16"
    with pytest.raises(ValueError, match="--dtype float32"):
        choose_large_path("bfloat16", None, avx2_cpu)
    if matmul_paths.int8_available():
        assert choose_large_path("float32", "w8a8_int8", avx2_cpu) == "w8a8_int8"
    for flags in (bf16_cpu, avx2_cpu):
        chosen = choose_large_path("auto", None, flags)
        assert FIDELITY[chosen]["passed"], chosen  # auto never picks a path that failed
        assert matmul_paths.auto_eligible(chosen), chosen
    expected = "bfloat16" if matmul_paths.auto_eligible("bfloat16") else "float32"
    if not matmul_paths.int8_available() or not any(
            matmul_paths.auto_eligible(p) for p in matmul_paths.FBGEMM_PATHS):
        assert choose_large_path("auto", None, bf16_cpu) == expected
    # Without bf16 dot products, float16 weights (passed; fbgemm's float32 arithmetic) come
    # before float32 wherever fbgemm is.
    assert FIDELITY["float16_weights"]["passed"]
    assert choose_large_path("auto", None, avx2_cpu) == (
        "float16_weights" if matmul_paths.fbgemm_cpu(avx2_cpu) else "float32")
    assert choose_large_path("auto", None, frozenset({"sse4_2"})) == "float32"  # no AVX2
    assert choose_large_path("float32", None, avx2_cpu) == "float32"  # exact by flag


def test_server_args_resolve_on_this_cpu():
    flags = host_cpu()[1]
    assert ServerArgs(dtype="float32").resolved_large_path == "float32"
    assert ServerArgs().resolved_large_path == choose_large_path("auto", None, flags)
    if matmul_paths.cpu_has_bf16(flags):
        assert ServerArgs(dtype="bfloat16").resolved_large_path == "bfloat16"
    else:
        with pytest.raises(ValueError, match="no bf16 dot products"):
            ServerArgs(dtype="bfloat16")
    if matmul_paths.int8_available():
        assert ServerArgs(quantization="w8a8_int8").resolved_large_path == "w8a8_int8"
        assert (ServerArgs(quantization="float16_weights").resolved_large_path
                == "float16_weights")
    with pytest.raises(ValueError, match="quantization='fp8'"):
        ServerArgs(quantization="fp8")
    with pytest.raises(ValueError, match="cpu only"):
        ServerArgs(device="npu", quantization="w8a8_int8")
    # OpenVINO graphs take their own weights: the path stays float32 under that runner.
    ov = ServerArgs(dtype="float32", enable_torch_compile=True, torch_compile_backend="openvino")
    assert ov.resolved_large_path == "float32"


@NEEDS_INT8
def test_float16_weights_round_the_weight_only():
    """float16_weights multiplies float32 activations by the weight rounded to float16, in float32
    arithmetic: against float64 over the float16-rounded weight it is as close as float32 is to
    its own reference (the activations are not rounded), and a weight beyond float16's range is
    refused with the flag to use instead."""
    torch.manual_seed(11)
    layer = Linear(576, 200, bias=False)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
    w16 = layer.weight.detach().half().double()
    layer.set_large_path("float16_weights")
    assert layer.weight is None and layer.weight_bytes(64) == 576 * 200 * 2
    x = torch.randn(64, 576) * torch.logspace(-3, 3, 576)  # activations of very unequal size
    assert relative_error(layer(x), x.double() @ w16.T) < TOLERANCE["float32"]
    # Compiled graphs reach the same product through its handle (the C++ one where built), and
    # the C++ operator gives the Python one's bits.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        layer(x)
    cpp = cpu_kernels.available()
    name = "airserve::fp16_weight_linear_cpp" if cpp else "airserve::fp16_weight_linear"
    assert name in {e.name for e in prof.events()}
    handle = layer.weight_fp16.handle
    if cpp:
        assert torch.equal(torch.ops.airserve.fp16_weight_linear_cpp(x, handle),
                           torch.ops.airserve.fp16_weight_linear(x, handle))
        del layer, prof  # the float16 weight goes, and C++ forgets it
        import gc

        gc.collect()
        with pytest.raises(RuntimeError, match=f"no float16 weight {handle}"):
            torch.ops.airserve.fp16_weight_linear_cpp(x, handle)
    big = Linear(8, 4, bias=False)
    with torch.no_grad():
        big.weight.fill_(1e5)
    with pytest.raises(ValueError, match="--dtype float32"):
        big.set_large_path("float16_weights")


@NEEDS_INT8
def test_float16_weights_packed_on_threads_equal_one_by_one():
    """The loader packs float16_weights layers on several threads (fbgemm packs on one core):
    a model packed on two threads multiplies to the same bits as one packed a layer at a time,
    a layer built from GGUF blocks alone (no float weight) is packed too, and a weight beyond
    float16's range still fails with the flag to use instead, from the worker thread."""
    from airserve.srt.model_loader.loader import set_large_path

    blocks = random_packed("q4_1", 48, 96) if block_matvec.kernels_available() else None

    def model() -> torch.nn.Module:
        torch.manual_seed(3)
        m = torch.nn.Sequential(*[Linear(96, 40 + 8 * i, bias=False) for i in range(5)])
        with torch.no_grad():
            for layer in m:
                layer.weight.normal_(0, 0.05)
        if blocks is not None:
            m.append(Linear(96, 48, bias=False))
            m[-1].attach_packed(blocks, 4, drop_weight=True)
        return m

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        on_two = model()
        set_large_path(on_two, "float16_weights")
        torch.set_num_threads(1)
        one_by_one = model()
        set_large_path(one_by_one, "float16_weights")
    finally:
        torch.set_num_threads(threads)
    x = torch.randn(33, 96)
    assert len(on_two) == (6 if blocks is not None else 5)
    for a, b in zip(on_two, one_by_one):
        assert a.large_path == "float16_weights" and a.weight is None
        assert a.weight_fp16.handle != b.weight_fp16.handle
        assert torch.equal(a(x), b(x))
    if blocks is not None:  # the blocks' layer: its float16 weight is the blocks dequantized
        ref = x.double() @ blocks.dequantize().half().double().T
        assert relative_error(on_two[-1](x), ref) < TOLERANCE["float32"]
    packs = matmul_paths.prepack_fp16_many([lambda: torch.ones(4, 8), lambda: torch.ones(2, 8)],
                                           threads=2)
    assert [(n, k) for _, n, k in packs] == [(4, 8), (2, 8)]
    big = torch.nn.Sequential(Linear(8, 4, bias=False), Linear(8, 4, bias=False))
    with torch.no_grad():
        big[1].weight.fill_(1e5)
    with pytest.raises(ValueError, match="--dtype float32"):
        set_large_path(big, "float16_weights")


def test_bf16_residual_channels_against_float64():
    """bf16 with the rounding error of the input's outlier channels added back in float32:
    the bf16 product (its output rounded to bf16, as torch's CPU bf16 matmul returns it) plus
    (x - bf16(x)) of those channels times their float32 weight columns; on an input whose few
    large channels carry most of the product, nearer float64 than plain bf16."""
    torch.manual_seed(5)
    k, n, hot = 192, 48, torch.tensor([3, 70, 150])
    w = torch.randn(n, k) * 0.05
    x = torch.randn(40, k) * 0.1
    x[:, hot] = torch.randn(40, len(hot)) * 60  # outlier channels
    ref = x.double() @ w.double().T
    plain, residual = Linear(k, n, bias=False), Linear(k, n, bias=False)
    for layer in (plain, residual):
        with torch.no_grad():
            layer.weight.copy_(w)
    plain.set_large_path("bfloat16")
    residual.set_large_path("bfloat16", outliers=hot)
    assert residual.weight is None and plain.weight_bf16.channels is None
    assert torch.equal(residual.weight_bf16.channels, hot)
    assert residual.weight_bytes(64) == n * k * 2 + len(hot) * n * 4 + len(hot) * 8
    xs = x[:, hot]
    by_hand = (torch.nn.functional.linear(x.bfloat16(), w.bfloat16()).float()
               + (xs - xs.bfloat16().float()) @ w[:, hot].T)
    torch.testing.assert_close(residual(x), by_hand, atol=1e-5, rtol=1e-6)
    err_plain, err_res = relative_error(plain(x), ref), relative_error(residual(x), ref)
    assert 1e-6 < err_res < min(err_plain, TOLERANCE["bfloat16"]), (err_res, err_plain)
    # The compiled form calls the same operator through its handle (the C++ one where built).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        residual(x)
    ops = {e.name for e in prof.events()}
    name = "airserve::bf16_linear_cpp" if cpu_kernels.available() else "airserve::bf16_linear"
    assert name in ops, sorted(ops)


@pytest.mark.parametrize("channels", [None, torch.tensor([2, 9, 40])], ids=["plain", "residual"])
def test_cpp_bf16_product_equals_the_python_one_and_is_released(channels):
    """bf16_linear_cpp (no Python on the call) gives the Python operator's bits, keeps bf16
    when asked (float32 where residual channels are added), and forgets a weight once its
    Bf16Weight is gone, with an error naming the handle."""
    if not cpu_kernels.available():
        pytest.fail(f"the C++ kernels did not build: {cpu_kernels.unavailable_reason()}")
    torch.manual_seed(3)
    w = matmul_paths.pack_bf16(torch.randn(96, 64), channels=channels)
    assert w.in_cpp
    for rows in (1, 7, 64):
        x = torch.randn(rows, 64)
        python = torch.ops.airserve.bf16_linear(x, w.handle)
        assert torch.equal(torch.ops.airserve.bf16_linear_cpp(x, w.handle, False), python)
        kept = matmul_paths.bf16_linear(x, w, keep_bf16=True)
        assert kept.dtype == (torch.bfloat16 if channels is None else torch.float32)
        assert torch.equal(kept.float(), python)
    handle = w.handle
    del w
    import gc

    gc.collect()
    with pytest.raises(RuntimeError, match=f"no bf16 weight {handle}"):
        torch.ops.airserve.bf16_linear_cpp(torch.randn(2, 64), handle, False)


def test_cpp_bf16_conversions_give_torchs_bits():
    """The bf16 path's own float32 -> bfloat16 cast gives torch's bits (round to nearest even,
    ties both ways, subnormals kept, overflow to inf, NaN stays NaN) and its widening is exact,
    on small tensors (one thread), large ones (split over threads) and strided views."""
    if not cpu_kernels.available():
        pytest.fail(f"the C++ kernels did not build: {cpu_kernels.unavailable_reason()}")
    torch.manual_seed(5)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -3e-39,
                            3.4e38, -3.39e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20,
                            2**-126, 65504.0, -1.0])
    for shape in [(7, 33), (64, 576), (600, 1000)]:
        x = torch.randn(*shape) * torch.logspace(-30, 30, shape[1])
        x.view(-1)[:special.numel()] = special
        for src in (x, x[:, ::2]):
            ours, ref = torch.ops.airserve.cast_to_bf16(src), src.to(torch.bfloat16)
            assert ours.dtype == torch.bfloat16 and ours.shape == src.shape
            nan = ref.isnan()
            assert torch.equal(ours.isnan(), nan)
            assert torch.equal(ours.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])
            wide = torch.ops.airserve.widen_to_f32(ref)
            assert wide.dtype == torch.float32
            assert torch.equal(wide.isnan(), nan)
            assert torch.equal(wide[~nan], ref.float()[~nan])
    with pytest.raises(RuntimeError, match="takes float32"):
        torch.ops.airserve.cast_to_bf16(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="takes bfloat16"):
        torch.ops.airserve.widen_to_f32(torch.zeros(3))


def test_loader_gives_down_proj_residual_channels(tmp_path):
    """--dtype bfloat16 on a GGUF: down_proj layers (matmul_paths.BF16_RESIDUAL_LAYERS) get
    BF16_RESIDUAL_CHANNELS residual channels from the calibration prefill, the other layers
    plain bf16; no float32 copy of any weight is kept but the tied lm_head's; the report
    names them."""
    if not block_matvec.kernels_available():
        pytest.fail(f"the block kernels did not build: {block_matvec.unavailable_reason()}")
    from airserve.srt.model_loader.loader import load_model
    from airserve_testing.tiny_gguf import write_tiny_gguf

    assert matmul_paths.BF16_RESIDUAL_LAYERS == ("down_proj",)
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, "llama")
    _, model = load_model(path, "float32", "cpu", packed_decode_max_bs=4, large_path="bfloat16")
    named = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    down = [m for n, m in named if n.endswith("down_proj")]
    channels = min(matmul_paths.BF16_RESIDUAL_CHANNELS, down[0].in_features)
    assert down and all(m.large_path == "bfloat16"
                        and m.weight_bf16.channels.numel() == channels for m in down)
    others = [(n, m) for n, m in named if not n.endswith("down_proj")]
    assert all(m.weight_bf16 is not None and m.weight_bf16.channels is None for _, m in others)
    assert all(m.weight is None for n, m in named if n != "lm_head"), "float32 copies kept"
    report = matmul_path_report([m for _, m in named], [n for n, _ in named])
    assert report[-1]["path"] == "bfloat16"
    assert report[-1]["bf16_residual_channels"] == {"down_proj": channels}


@pytest.mark.parametrize("channels", [None, torch.tensor([2, 9, 40])], ids=["plain", "residual"])
def test_forward_bf16_equals_forward_on_the_float32_activations(channels):
    """Linear.forward_bf16 (activations that arrive as their bf16 rounding, with the rounding's
    error at the weight's residual channels) gives forward's bits on the float32 activations;
    an error tensor of the wrong width is refused with the width it needs."""
    if not cpu_kernels.available():
        pytest.fail(f"the C++ kernels did not build: {cpu_kernels.unavailable_reason()}")
    torch.manual_seed(8)
    layer = Linear(64, 96, bias=True)
    with torch.no_grad():
        layer.weight.normal_(0, 0.1)
        layer.bias.normal_(0, 0.1)
    layer.set_large_path("bfloat16", outliers=channels)
    k = 0 if channels is None else len(channels)
    for rows in (1, 9, 64):
        assert layer.takes_bf16_input(rows, decode=False)
        x = torch.randn(rows, 64) * 3
        xb = x.bfloat16()
        err = (x - xb.float())[:, channels] if k else torch.empty(rows, 0)
        assert torch.equal(layer.forward_bf16(xb, err), layer(x))
    with pytest.raises(RuntimeError, match=rf"err must be float32 \[4, {k}\]"):
        layer.forward_bf16(torch.randn(4, 64).bfloat16(), torch.zeros(4, k + 1))
