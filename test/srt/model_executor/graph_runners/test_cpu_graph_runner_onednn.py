"""The float32 path by oneDNN (--cpu-float32-matmul onednn, the default where torch has it) in
a real model: CPUGraphRunner buckets above --packed-decode-max-bs call airserve::onednn_linear
inside their graphs and match eager; eager oneDNN gives the greedy tokens of the plain sgemm
path; no layer keeps a plain float32 weight beside its reordered one. Tiny GGUF model (tied
lm_head, Q4_0/Q4_1/Q8_0 layers)."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.layers.linear import Linear
from airserve.srt.layers.quant import matmul_paths
from airserve_testing import (
    q4_1_decode_op,
    random_prompts,
    replay_matches_eager,
    run_side_by_side,
    tiny_gguf_runners,
)

# Both float32; only the summation order differs (oneDNN vs sgemm, inductor's fusions).
ATOL = 1e-4
PACKED_LIMIT = 2
BUCKETS = (2, 4)

pytestmark = pytest.mark.skipif(not matmul_paths.onednn_available(),
                                reason="torch has no oneDNN (mkldnn) on this machine")


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    # --cpu-float32-matmul auto: onednn; the reference multiplies by sgemm. float32 pinned: on
    # CPUs with avx512_bf16 or AMX --dtype auto takes the bfloat16 path, which has no oneDNN
    # float32 product to test.
    # Exact decode activations: these compare the buckets with eager at 1e-4, which int16's
    # rounding does not keep (a last-bit difference of the graph's fused float work at a
    # rounding boundary becomes a step); test_decode_activations.py compares int8 and
    # auto's int16 graphs with eager.
    return tiny_gguf_runners(str(tmp_path_factory.mktemp("onednn")), BUCKETS, PACKED_LIMIT,
                             reference=dict(cpu_float32_matmul="sgemm", dtype="float32"),
                             dtype="float32", cpu_decode_activations="float32")


def linears(runner) -> list[Linear]:
    return [m for m in runner.model.modules() if isinstance(m, Linear)]


def test_weights_and_report(runners):
    graph, _, sgemm = runners
    layers = linears(graph)
    lm_head = graph.model.lm_head
    # One float32 form per layer: the reordered one; the tied lm_head keeps the embedding's
    # own tensor (not a copy) beside its reordered form.
    assert lm_head.float32_impl == "onednn"
    assert lm_head.weight.data_ptr() == graph.model.model.embed_tokens.weight.data_ptr()
    others = [m for m in layers if m is not lm_head]
    assert others and all(m.weight is None and m.float32_impl == "onednn" for m in others)
    float_params = sum(p.numel() for p in graph.model.parameters())
    plain_params = sum(p.numel() for p in sgemm.model.parameters())
    assert plain_params - float_params == sum(m.in_features * m.out_features for m in others)
    assert graph.kernels_report()["matmul_paths"] == [
        {"rows": f"1-{PACKED_LIMIT}", "path": "packed"},
        {"rows": f"{PACKED_LIMIT + 1}+", "path": "float32",
         "float32_impl": {"onednn": len(others) + 1}}]
    assert {m.float32_impl for m in linears(sgemm)} == {"sgemm"}


def ops_run(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("airserve::")}


@pytest.mark.parametrize("bs", [2, 3, 4])
def test_buckets_match_eager_on_onednn(runners, bs):
    graph, eager, _ = runners
    fallbacks = sum(graph.fallback_counts.values())
    te, reqs = replay_matches_eager(graph, eager, bs, ATOL)
    assert sum(graph.fallback_counts.values()) == fallbacks
    replays = graph.graph_runner.replay_count
    ops = ops_run(lambda: reqs[0].decode(te[-1].tolist()))  # one more replay, profiled
    assert graph.graph_runner.replay_count == replays + 1
    assert ("airserve::onednn_linear" in ops) == (bs > PACKED_LIMIT), ops
    assert (q4_1_decode_op(graph) in ops) == (bs <= PACKED_LIMIT), ops
    for r in reqs:
        r.release()


def test_onednn_greedy_equals_sgemm(runners):
    """Eager, prefill and decode batches above the limit: the same greedy tokens as F.linear."""
    _, eager, sgemm = runners
    prompts = random_prompts(eager.model_config.vocab_size, [7, 11, 6, 9], seed=3)
    lo, ls, to, ts, reqs = run_side_by_side(eager, sgemm, prompts, steps=8)
    torch.testing.assert_close(lo, ls, atol=ATOL, rtol=0)
    assert torch.equal(to, ts)
    assert torch.equal(reqs[0].prefill_logits.argmax(-1), reqs[1].prefill_logits.argmax(-1))
    ops = ops_run(lambda: reqs[0].decode(to[-1].tolist()))
    assert "airserve::onednn_linear" in ops, ops
    assert "airserve::onednn_linear" not in ops_run(lambda: reqs[1].decode(ts[-1].tolist()))
    for r in reqs:
        r.release()
