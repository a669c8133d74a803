"""CPUGraphRunner buckets share one compiled graph (batch dimension dynamic), on both sides of
the packed limit, and each bucket still equals eager on the path eager takes for it.

Tiny GGUF model with Q4_0/Q4_1/Q8_0 layers (merged q/k/v of two block kinds), the default
buckets (1, 2, 4, 8 at 8 running requests) and --packed-decode-max-bs 2: buckets 1 and 2 multiply
with the packed kernels, 4 and 8 with the float32 weights, all in one graph
(airserve::packed_or_large picks the product per call): bs 1 gets no static graph of its own.
One compile for every bucket, counted by dynamo itself.
"""

from __future__ import annotations

import pytest
import torch

from airserve.srt.model_executor.graph_runners.base import dynamo_graph_count
from airserve_testing import q4_1_decode_op, replay_matches_eager, tiny_gguf_runners

ATOL = 1e-4  # float32 on both sides; inductor reorders reductions
PACKED_LIMIT = 2
BUCKETS = [1, 2, 4, 8]  # the default schedule (powers of two) up to 8 running requests


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    before = dynamo_graph_count()
    # Exact decode activations: these compare the buckets with eager at 1e-4, which int16's
    # rounding does not keep (a last-bit difference of the graph's fused float work at a
    # rounding boundary becomes a step); test_decode_activations.py compares int8 and
    # auto's int16 graphs with eager.
    graph, eager, _ = tiny_gguf_runners(str(tmp_path_factory.mktemp("dynamic")), None,
                                        PACKED_LIMIT, reference={},
                                        cpu_decode_activations="float32")
    return graph, eager, dynamo_graph_count() - before


def test_every_bucket_shares_one_compile(runners):
    graph, _, dynamo_compiles = runners
    gr = graph.graph_runner
    assert dynamo_compiles == 1  # dynamo's own count: no guard on the packed limit
    report = gr.report()
    assert gr.buckets == BUCKETS
    assert report["graphs_compiled"] == 1
    assert report["buckets_compiled"] == BUCKETS
    assert report["cpp_wrapper"] is True  # the generated wrapper is C++ (no Python per op)
    assert len({id(gr.graphs[bs]) for bs in BUCKETS}) == 1  # bs 1 too
    assert gr.graphs[4].symbolic  # compiled with a symbolic batch size
    assert gr.capture_args[1] != gr.capture_args[2]  # called with each bucket's batch


def ops_run(fn) -> set[str]:
    """Names of the airserve operators `fn` calls (compiled graphs call them too)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("airserve::")}


@pytest.mark.parametrize("bs", [1, 2, 3, 8])
def test_each_bucket_of_a_shared_graph_matches_eager(runners, bs):
    graph, eager, _ = runners
    gr = graph.graph_runner
    te, reqs = replay_matches_eager(graph, eager, bs, ATOL)
    assert gr.bucket_for(bs) in gr.direct  # replayed without dynamo
    # One more replay, profiled: the shared graph took this bucket's side of the limit.
    ops = ops_run(lambda: reqs[0].decode(te[-1].tolist()))
    packed = gr.bucket_for(bs) <= PACKED_LIMIT  # bs 3 runs padded in bucket 4
    assert (q4_1_decode_op(graph) in ops) == packed, ops
    assert ("airserve::q8_0_matmul" in ops) == packed, ops
    assert "airserve::packed_or_large" in ops
    assert gr.recompiles_since_capture() == 0
    for r in reqs:
        r.release()


def test_tensor_parallel_graphs_keep_the_python_wrapper():
    """The C++ wrapper cannot call torch's functional collectives on CPU: TP runners keep the
    Python wrapper, single-rank runners use the C++ one."""
    from airserve.srt.model_executor.graph_runners.cpu import inductor_options

    assert inductor_options(1)["cpp_wrapper"] is True
    assert inductor_options(2)["cpp_wrapper"] is False
    assert inductor_options(2)["size_asserts"] is False  # the other options unchanged


def test_wrapper_and_kernels_build_at_their_levels(monkeypatch, tmp_path):
    """Under the runner's inductor options g++ builds the C++ wrapper at WRAPPER_OPT_LEVEL (-O1:
    -O0 built 4x faster but slowed every step ~6%), the kernels at -O3: the compiler commands of
    a real compile, recorded as inductor runs them in this process. The variable
    AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL, where set, decides instead."""
    import time

    import torch._inductor.config as inductor_config

    from airserve.srt.model_executor.graph_runners.cpu import WRAPPER_OPT_LEVEL, inductor_options
    from airserve_testing.compiled_start import count_compiler_runs

    monkeypatch.delenv("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", raising=False)
    options = inductor_options(1)
    assert options["aot_inductor.compile_wrapper_opt_level"] == WRAPPER_OPT_LEVEL == "O1"
    monkeypatch.setenv("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O2")
    assert "aot_inductor.compile_wrapper_opt_level" not in inductor_options(1)
    commands = count_compiler_runs(monkeypatch.setattr)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing cached: it builds
    torch._dynamo.reset()
    # A constant of its own: no kernel this process built before has the same source.
    c = 2.0 + (time.time_ns() % 100_003) / 100_003
    with inductor_config.patch({**options, "force_disable_caches": True}):
        step = torch.compile(lambda x: (x * c).sin() + 1.0, backend="inductor", fullgraph=True)
        x = torch.randn(16)
        torch.testing.assert_close(step(x), (x * c).sin() + 1.0)
    torch._dynamo.reset()
    wrapper = [c for c in commands if ".main.cpp" in c]
    assert wrapper, commands
    assert all(" -O1 " in f"{c} " and " -O0 " not in f"{c} " for c in wrapper), wrapper
    # The kernels (built here, or in inductor's compile workers where a pool runs) keep -O3.
    kernels = [c for c in commands if ".cpp " in f"{c} " and ".main.cpp" not in c
               and "header" not in c]
    assert all(" -O3 " in f"{c} " for c in kernels), kernels
