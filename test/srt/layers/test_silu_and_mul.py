"""silu(gate) * up over a merged gate/up output (layers/activation.py, csrc/activation.cpp):
the C++ operator's vector and plain loops against a float64 reference on float32 and bfloat16
inputs (widths that leave a tail after the 8-lane loop, 1 and 2 threads, values far beyond the
exponential's clamp, infinities and NaN), the plain-torch path it replaces, its errors, and the
MLP feeding it a bfloat16 product."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from airserve.srt.layers import cpu_kernels
from airserve.srt.layers.activation import silu_and_mul

# float32 arithmetic against float64: the polynomial exponential's ~1e-7 relative error plus a
# division and a product.
RTOL, ATOL = 2e-6, 1e-30


def ops():
    if not cpu_kernels.available():
        pytest.skip(f"C++ kernels not built: {cpu_kernels.unavailable_reason()}")
    return [torch.ops.airserve.silu_and_mul, torch.ops.airserve.silu_and_mul_portable]


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.double().chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width,threads", [(1, 8, 1), (3, 13, 1), (512, 1536, 2),
                                                (37, 100, 2), (5, 1, 1)])
def test_against_float64(dtype, rows, width, threads):
    torch.manual_seed(rows * width)
    gate_up = (torch.randn(rows, 2 * width) * 4).to(dtype)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for op in ops():
            out = op(gate_up)
            assert out.dtype == torch.float32 and out.shape == (rows, width)
            torch.testing.assert_close(out.double(), reference(gate_up), rtol=RTOL, atol=ATOL)
    finally:
        torch.set_num_threads(saved)


def test_extremes():
    """Beyond the exponential's [-87, 88] clamp silu is still x (large x) and ~0 (very negative
    x, down to -3e38); infinities and NaN come out as torch's silu gives them."""
    g = torch.tensor([-1e4, -200.0, -88.5, -87.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 87.5, 89.0,
                      200.0, 1e4, 3e38, -3e38, float("inf"), float("-inf"), float("nan")])
    g = torch.cat([g, g[:6]])  # 24 lanes: three 8-lane vectors, no tail
    gate_up = torch.cat([g, torch.full_like(g, 0.5)]).unsqueeze(0)
    expected = (F.silu(g.double()) * 0.5).unsqueeze(0)
    for op in ops():
        out = op(gate_up)
        finite = expected.isfinite()
        torch.testing.assert_close(out[finite].double(), expected[finite], rtol=RTOL, atol=1e-30)
        assert out[~finite].isnan().tolist() == expected[~finite].isnan().tolist()
        assert (out[~finite & ~expected.isnan()] == expected[~finite & ~expected.isnan()]).all()


def test_matches_torch_path():
    """The operator against the plain torch ops it replaces (F.silu(gate) * up in float32)."""
    ops()
    torch.manual_seed(0)
    gate_up = torch.randn(64, 2 * 1536).bfloat16()
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(gate_up, torch.float32), F.silu(gate) * up,
                               rtol=1e-6, atol=1e-7)
    # float32 input keeps the torch ops (exact as before)
    f = gate_up.float()
    assert torch.equal(silu_and_mul(f), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_keeps_its_dtype(dtype):
    """A bf16 or f16 model's gate/up product (its activations in that dtype, as on GPU or under
    the OpenVINO runner) comes out in that dtype for its down projection, not widened."""
    gate_up = torch.randn(5, 64).to(dtype)
    out = silu_and_mul(gate_up, dtype)
    assert out.dtype == dtype
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(out, F.silu(gate) * up)
    assert silu_and_mul(gate_up).dtype == dtype


def test_errors():
    op = ops()[0]
    with pytest.raises(RuntimeError, match="must be even"):
        op(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match=r"\[rows, 2 \* n\]"):
        op(torch.randn(8))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.randn(2, 8).half())


def bf16_mlp(seed: int, down_outliers: torch.Tensor | None = None):
    """An MLP of 64 -> 2 x 96 -> 64 with random weights, both projections on the bfloat16
    path (down_proj with residual channels at `down_outliers`, if given)."""
    from airserve.srt.models.llama import MLP

    torch.manual_seed(seed)
    mlp = MLP(SimpleNamespace(hidden_size=64, intermediate_size=96))  # all MLP reads
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.2)
    mlp.gate_up_proj.set_large_path("bfloat16")
    mlp.down_proj.set_large_path("bfloat16", outliers=down_outliers)
    return mlp


def test_mlp_bf16_path_uses_bf16_product():
    """An MLP on the bfloat16 large path hands silu_and_mul the bf16 gate/up product (no
    float32 copy of it) and computes what the float32-widened route computes."""
    ops()
    mlp = bf16_mlp(seed=1)
    x = torch.randn(40, 64)
    seen = []
    handle = mlp.gate_up_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = mlp(x)
    handle.remove()
    assert seen == [torch.bfloat16]
    gu = mlp.gate_up_proj(x)  # float32, widened
    assert gu.dtype == torch.float32
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(out, mlp.down_proj(F.silu(gate) * up), rtol=0, atol=0)


@pytest.mark.parametrize("rows,n", [(1, 8), (5, 37), (64, 1536)])
@pytest.mark.parametrize("channels", [None, [0, 3, 6]], ids=["plain", "residual"])
def test_bf16_form_gives_the_float32_routes_bits(rows, n, channels):
    """silu_and_mul_bf16 hands a bf16 down projection what the float32 route would cast for it:
    the float32 operator's product rounded by torch's rounding, bit for bit, and that product
    less its rounding at the residual channels; 1 and 2 threads alike."""
    ops()
    torch.manual_seed(rows + n)
    gate_up = (torch.randn(rows, 2 * n) * 4).bfloat16()
    gate_up[0, 1] = float("inf")  # silu(inf) * up: an infinity keeps its bits too
    ch = None if channels is None else torch.tensor(channels)
    product = torch.ops.airserve.silu_and_mul(gate_up)  # float32
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            act, err = torch.ops.airserve.silu_and_mul_bf16(gate_up, ch)
        finally:
            torch.set_num_threads(before)
        assert act.dtype == torch.bfloat16 and act.shape == (rows, n)
        assert torch.equal(act.view(torch.int16), product.bfloat16().view(torch.int16))
        if ch is None:
            assert err.shape == (rows, 0) and err.dtype == torch.float32
        else:
            kept = product[:, ch]
            assert torch.equal(err, kept - kept.bfloat16().float())
            assert err.abs().max() > 0  # the rounding is not zero on random values


def test_bf16_form_errors():
    ops()
    op = torch.ops.airserve.silu_and_mul_bf16
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        op(torch.randn(2, 8), None)
    with pytest.raises(RuntimeError, match=r"\[rows, 2 \* n\]"):
        op(torch.randn(2, 7).bfloat16(), None)
    with pytest.raises(RuntimeError, match="residual channel 4 out of range for 4"):
        op(torch.randn(2, 8).bfloat16(), torch.tensor([1, 4]))


def test_mlp_sends_bf16_activations_to_a_bf16_down_projection():
    """With both projections on the bfloat16 path in C++, the MLP hands down_proj bf16
    activations and their rounding error at its residual channels (no float32 [rows, N]
    product in between) and gets the float32 route's output bit for bit; a down projection
    on the float32 path takes the float32 route."""
    ops()
    from airserve.srt.layers.activation import silu_and_mul_product
    from airserve.srt.models.llama import MLP

    mlp = bf16_mlp(seed=2, down_outliers=torch.tensor([5, 17, 90]))
    assert mlp.down_proj.weight_bf16.in_cpp
    x = torch.randn(40, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = mlp(x)
    names = {e.name for e in prof.events()}
    assert {"airserve::silu_and_mul_bf16", "airserve::bf16_linear_from_bf16"} <= names
    assert "airserve::bf16_linear_cpp" in names  # gate/up, from float32 x
    gate_up = mlp.gate_up_proj(x, keep_bf16=True)
    assert gate_up.dtype == torch.bfloat16
    assert torch.equal(out, mlp.down_proj(silu_and_mul(gate_up, torch.float32)))
    float32_down = MLP(SimpleNamespace(hidden_size=64, intermediate_size=96))  # float32 path
    assert silu_and_mul_product(gate_up, float32_down.down_proj, False) is None
