"""CPUGraphRunner buckets above --packed-decode-max-bs run the large-batch matmul path
(w8a8_int8 and float16_weights, on any x86 CPU with fbgemm; bfloat16 too on CPUs with bf16 dot
products) and match
eager on the same path; buckets at or below the limit keep the packed kernels. Tiny GGUF model
with Q4_0/Q4_1/Q8_0 layers."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.hardware import host_cpu
from airserve.srt.layers.linear import Linear
from airserve.srt.layers.quant import matmul_paths
from airserve_testing import (
    Requests,
    q4_1_decode_op,
    random_prompts,
    replay_matches_eager,
    run_side_by_side,
    tiny_gguf_runners,
)

# Same path on both sides; inductor reorders the float work around the int8 products.
ATOL = 1e-4
# bfloat16 on both sides: the same bf16 products; inductor may fuse the casts around them and
# the float32 work in between, so results may differ in float32 rounding (measured: 0 on an AMD
# EPYC with avx512_bf16; the float32 runner's logits differ from bf16 eager's by ~9).
BF16_ATOL = 1e-4
PACKED_LIMIT = 2
BUCKETS = (2, 4)

pytestmark = pytest.mark.skipif(not matmul_paths.int8_available(),
                                reason="torch has no fbgemm engine on this machine")


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    # Exact decode activations: these compare the buckets with eager at 1e-4, which int16's
    # rounding does not keep (a last-bit difference of the graph's fused float work at a
    # rounding boundary becomes a step); test_decode_activations.py compares int8 and
    # auto's int16 graphs with eager.
    return tiny_gguf_runners(str(tmp_path_factory.mktemp("paths")), BUCKETS, PACKED_LIMIT,
                             reference=dict(dtype="float32"), quantization="w8a8_int8",
                             cpu_decode_activations="float32")


def test_paths_per_rows_and_report(runners):
    graph, _, _ = runners
    layers = [m for m in graph.model.modules() if isinstance(m, Linear)]
    assert all(m.path_for(PACKED_LIMIT) == "packed" for m in layers)
    assert all(m.path_for(BUCKETS[1]) == "w8a8_int8" for m in layers)
    assert graph.kernels_report()["matmul_paths"] == [
        {"rows": f"1-{PACKED_LIMIT}", "path": "packed", "extend_rows": "large path"},
        {"rows": f"{PACKED_LIMIT + 1}+", "path": "w8a8_int8"}]
    # Only the tied lm_head (the embedding's weight) keeps float32 values.
    assert sum(m.weight is not None for m in layers) == 1


def ops_run(fn) -> set[str]:
    """Names of the airserve operators `fn` calls (compiled graphs call them too)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("airserve::")}


@pytest.mark.parametrize("bs", [2, 3, 4])
def test_buckets_match_eager_on_the_same_path(runners, bs):
    graph, eager, _ = runners
    te, reqs = replay_matches_eager(graph, eager, bs, ATOL)
    replays = graph.graph_runner.replay_count
    # One more replay, profiled: the bucket's products are int8 above the packed limit.
    ops = ops_run(lambda: reqs[0].decode(te[-1].tolist()))
    assert graph.graph_runner.replay_count == replays + 1
    assert ("airserve::w8a8_linear" in ops) == (bs > PACKED_LIMIT), ops
    assert (q4_1_decode_op(graph) in ops) == (bs <= PACKED_LIMIT), ops
    for r in reqs:
        r.release()


def test_float32_runner_differs(runners):
    """The int8 path changes numerics (so the comparison above is not float32 twice)."""
    _, eager, float32 = runners
    prompts = random_prompts(eager.model_config.vocab_size, [7, 11, 6])
    a, b = Requests(eager, prompts), Requests(float32, prompts)
    assert (a.prefill_logits - b.prefill_logits).abs().max() > ATOL
    a.release()
    b.release()


@pytest.fixture(scope="module")
def bf16_runners(tmp_path_factory):
    if not matmul_paths.cpu_has_bf16(host_cpu()[1]):
        pytest.skip("this CPU has no bf16 dot products: --dtype bfloat16 is refused here")
    return tiny_gguf_runners(str(tmp_path_factory.mktemp("bf16")), BUCKETS, PACKED_LIMIT,
                             reference=dict(dtype="float32"), dtype="bfloat16")


@pytest.mark.parametrize("bs", [3, 4])
def test_bf16_buckets_match_eager_on_the_same_path(bf16_runners, bs):
    graph, eager, float32 = bf16_runners
    named = [(n, m) for n, m in graph.model.named_modules() if isinstance(m, Linear)]
    # down_proj with residual channels (matmul_paths.BF16_RESIDUAL_LAYERS), the rest plain.
    assert all(m.path_for(bs) == "bfloat16" for _, m in named)
    assert all((m.weight_bf16.channels is not None) == n.endswith("down_proj") for n, m in named)
    _, reqs = replay_matches_eager(graph, eager, bs, BF16_ATOL)
    assert not graph.fallback_counts
    for r in reqs:
        r.release()
    # Not float32 twice: the float32 runner's logits differ by more than the tolerance.
    prompts = random_prompts(graph.model_config.vocab_size, [5, 17, 9, 12][:bs])
    lf, le, _, _, reqs = run_side_by_side(float32, eager, prompts, steps=1)
    assert (lf - le).abs().max() > BF16_ATOL
    for r in reqs:
        r.release()


@pytest.fixture(scope="module")
def fp16_runners(tmp_path_factory):
    # Exact decode activations: these compare the buckets with eager at 1e-4, which int16's
    # rounding does not keep (a last-bit difference of the graph's fused float work at a
    # rounding boundary becomes a step); test_decode_activations.py compares int8 and
    # auto's int16 graphs with eager.
    return tiny_gguf_runners(str(tmp_path_factory.mktemp("fp16w")), BUCKETS, PACKED_LIMIT,
                             reference=dict(dtype="float32"), quantization="float16_weights",
                             cpu_decode_activations="float32", cpu_large_activations="float")


@pytest.fixture(scope="module")
def int8_blocks_runners(tmp_path_factory):
    # int8_blocks in every Q4_1 layer (--cpu-large-activations int8) beside float16_weights.
    return tiny_gguf_runners(str(tmp_path_factory.mktemp("int8b")), BUCKETS, PACKED_LIMIT,
                             reference=dict(dtype="float32"), quantization="float16_weights",
                             cpu_decode_activations="float32", cpu_large_activations="int8")


@pytest.mark.parametrize("bs", [3, 4])
def test_int8_blocks_buckets_match_eager_on_the_same_path(int8_blocks_runners, bs):
    graph, eager, _ = int8_blocks_runners
    layers = [m for m in graph.model.modules() if isinstance(m, Linear)]
    int8 = [m for m in layers if m.large_int8]
    assert int8 and all(m.packed_kinds == ("q4_1",) for m in int8)
    assert all(m.path_for(bs) == "int8_blocks" for m in int8)
    te, reqs = replay_matches_eager(graph, eager, bs, ATOL)
    assert not graph.fallback_counts
    replays = graph.graph_runner.replay_count
    ops = ops_run(lambda: reqs[0].decode(te[-1].tolist()))
    assert graph.graph_runner.replay_count == replays + 1
    assert "airserve::gemm_int8_blocks" in ops, ops
    for r in reqs:
        r.release()


@pytest.mark.parametrize("bs", [2, 3, 4])
def test_float16_weight_buckets_match_eager_on_the_same_path(fp16_runners, bs):
    graph, eager, float32 = fp16_runners
    layers = [m for m in graph.model.modules() if isinstance(m, Linear)]
    assert all(m.path_for(bs) == ("packed" if bs <= PACKED_LIMIT else "float16_weights")
               for m in layers)
    te, reqs = replay_matches_eager(graph, eager, bs, ATOL)
    assert not graph.fallback_counts
    ops = ops_run(lambda: reqs[0].decode(te[-1].tolist()))
    fp16 = {"airserve::fp16_weight_linear", "airserve::fp16_weight_linear_cpp"}
    assert bool(fp16 & ops) == (bs > PACKED_LIMIT), ops
    for r in reqs:
        r.release()
    if bs > PACKED_LIMIT:  # not float32 twice: the weights' float16 rounding shows
        prompts = random_prompts(graph.model_config.vocab_size, [5, 17, 9, 12][:bs])
        lf, le, _, _, reqs = run_side_by_side(float32, eager, prompts, steps=1)
        assert (lf - le).abs().max() > 0
        for r in reqs:
            r.release()
