"""airserve::packed_or_large picks, per call, the product Linear.forward takes for that many rows
(the packed blocks up to the layer's limit, its large path above) and returns the same values:
every large path, one block kind and mixed kinds, with and without bias, eager and compiled with
a symbolic row count (one graph for both sides of the limit)."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.layers.linear import Linear
from airserve.srt.layers.quant import block_matvec, matmul_paths
from airserve.srt.layers.quant.packed_or_large import packed_or_large
from airserve_testing.tiny_gguf import any_packed

LIMIT = 4
N, K = 96, 64
ROWS = (1, 3, LIMIT, LIMIT + 1, 16, 33)


@pytest.fixture(autouse=True)
def _kernels():
    if not block_matvec.kernels_available():
        pytest.fail(f"the block kernels did not build: {block_matvec.unavailable_reason()}")


def layer(kinds: tuple[str, ...], bias: bool = False) -> Linear:
    parts = [any_packed(kind, N // len(kinds), K, seed=i) for i, kind in enumerate(kinds)]
    lin = Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.cat([p.dequantize() for p in parts]))
    lin.attach_packed(parts, LIMIT, "auto")
    return lin


def large_paths() -> list[tuple[str, str]]:
    paths = [("float32", "sgemm"), ("bfloat16", "sgemm")]
    if matmul_paths.onednn_available():
        paths.append(("float32", "onednn"))
    if matmul_paths.int8_available():
        paths += [("w8a8_int8", "sgemm"), ("float16_weights", "sgemm")]
    return paths


@pytest.mark.parametrize("path,impl", large_paths())
@pytest.mark.parametrize("kinds", [("q4_1",), ("q4_1", "q8_0"), ("q8_0", "q5_0")])
def test_equals_linear_forward_on_each_side(path, impl, kinds) -> None:
    lin = layer(kinds, bias=kinds == ("q4_1",))
    lin.set_large_path(path, float32_impl=impl)
    g = torch.Generator().manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, K, generator=g)
        for decode in (True, False):
            want = lin(x, decode)  # eager: the path decided in Python
            got = packed_or_large(lin, x, decode)
            assert torch.equal(got, want), (path, impl, kinds, rows, decode)
    # The two sides differ (int8 decode activations against the large path): the operator did
    # not take one side for every row count.
    x = torch.randn(LIMIT, K, generator=g)
    small = packed_or_large(lin, x, True)
    big = packed_or_large(lin, torch.cat([x, x]), True)[:LIMIT]
    assert not torch.equal(small, big)


@pytest.mark.parametrize("activations", ["int16", "auto"])
def test_k_quants_take_their_int16_products(activations: str) -> None:
    """A layer of Q4_K and Q6_K blocks (K a multiple of 256) under int16 activations: the
    operator's packed side calls their int16 products as Linear.forward does."""
    k = 512
    parts = [any_packed(kind, 40, k, seed=i) for i, kind in enumerate(("q4_k", "q6_k"))]
    lin = Linear(k, 80, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.cat([p.dequantize() for p in parts]))
    lin.attach_packed(parts, LIMIT, activations)
    g = torch.Generator().manual_seed(2)
    for rows in (1, LIMIT, LIMIT + 3):
        x = torch.randn(rows, k, generator=g)
        assert torch.equal(packed_or_large(lin, x, True), lin(x, True)), rows
    x = torch.randn(2, k, generator=g)
    if block_matvec.resolve_activations(activations, "q4_k") == "int16":
        want = torch.cat([block_matvec.packed_linear(x, p, "int16") for p in parts], dim=1)
        assert torch.equal(packed_or_large(lin, x, True), want)


def test_dequantized_large_path_is_left_to_the_caller() -> None:
    lin = Linear(K, N, bias=False)
    lin.attach_packed(any_packed("q4_1", N, K), LIMIT, "float32", drop_weight=True)
    assert packed_or_large(lin, torch.randn(2, K), True) is None


def test_one_compiled_graph_serves_both_sides() -> None:
    lin = layer(("q4_1", "q8_0"))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    step = torch.compile(lambda x: lin(x, True), backend=backend, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(2)
    for rows in (2, 3, LIMIT, LIMIT + 1, 16):
        x = torch.randn(rows, K, generator=g)
        assert torch.equal(step(x), lin(x, True)), rows
    assert len(graphs) == 1  # no guard on the limit


def test_single_segment_codes_match_the_cpp_tables() -> None:
    """packed_or_large_1 takes its kind, activations and large path as indices into the Python
    tables; the C++ operator must hold the same names in the same order, and refuse a code
    outside them."""
    from airserve.srt.layers.quant import packed_or_large as pol

    names = torch.ops.airserve_codes.packed_or_large_names
    assert names("kind") == list(block_matvec.KINDS)
    assert names("activations") == list(pol.ACTIVATIONS)
    assert names("path") == list(pol.LARGE_PATHS)
    lin = layer(("q4_1",))
    qs, d, m = lin._segment(0)
    x = torch.randn(2, K)
    for bad in ({"kind": len(block_matvec.KINDS)}, {"path": -1}, {"activations": 7}):
        args = {"kind": 0, "activations": 0, "path": 0} | bad
        with pytest.raises(RuntimeError, match=f"{next(iter(bad))} code"):
            torch.ops.airserve.packed_or_large_1(x, LIMIT if "path" not in bad else 0,
                                                 args["kind"], args["activations"], qs, d, m,
                                                 args["path"], -1, lin.weight)


def test_single_segment_schema_takes_the_light_cpp_wrapper_call() -> None:
    """A schema of tensors and ints is one inductor's C++ wrapper calls through its StableIValue
    bridge instead of building an IValue stack with strings per call (the wrapper's compile
    time, quant/packed_or_large.py)."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    assert CppWrapperCpu._compatible_with_stableivalue(torch.ops.airserve.packed_or_large_1.default)
