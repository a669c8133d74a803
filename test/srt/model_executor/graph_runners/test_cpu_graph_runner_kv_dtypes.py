"""--kv-cache-dtype bfloat16, float16 and int8 on CPU: the pool holds 16-bit values (or int8 rows
with their scales), decode reads them through the C++ operator (float32 arithmetic) in eager
steps and in the CPU graph runner's buckets alike, and the buckets match eager on the same
cache; a float32 cache gives different (close) logits."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.layers import cpu_kernels
from airserve.srt.model_executor.graph_runners.cpu import CPUGraphRunner
from airserve_testing import Requests, make_runner, random_prompts, replay_matches_eager

# The same 16-bit cache on both sides; inductor fuses and reorders the float32 work around the
# attention.
ATOL = 1e-4
BUCKETS = (1, 4)


@pytest.fixture(scope="module", params=["bfloat16", "float16", "int8"])
def runners(tiny_llama_dir, request):
    if not cpu_kernels.available():
        pytest.fail(f"the C++ kernels did not build: {cpu_kernels.unavailable_reason()}")
    kv = request.param
    eager = make_runner(tiny_llama_dir, kv_cache_dtype=kv, dtype="float32")
    graph = make_runner(tiny_llama_dir, runner_from=eager, kv_cache_dtype=kv,
                        dtype="float32", enable_torch_compile=True, cuda_graph_bs=BUCKETS)
    float32 = make_runner(tiny_llama_dir, runner_from=eager, dtype="float32")
    assert isinstance(graph.graph_runner, CPUGraphRunner)
    return graph, eager, float32


def decode_ops(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def test_pool_dtype_and_bytes(runners):
    graph, eager, float32 = runners
    kv = eager.kv_dtype
    assert kv in (torch.bfloat16, torch.float16, torch.int8)
    assert all(b.dtype == kv for b in eager.kv_pool.k_buffers + eager.kv_pool.v_buffers)
    assert eager.kernels_report()["kv_cache_dtype"] == str(kv).removeprefix("torch.")
    assert eager.kernels_report()["cpp_decode_attention"]
    head_dim = eager.kv_pool.head_dim
    # Half a float32 cache's bytes, or for int8 a quarter plus each row's 4-byte scale.
    per_row = 2 * head_dim if kv != torch.int8 else head_dim + 4
    assert (eager.kv_pool.memory_bytes() * 4 * head_dim
            == float32.kv_pool.memory_bytes() * per_row)


@pytest.mark.parametrize("bs", [1, 3, 4])
def test_buckets_match_eager_on_the_same_cache(runners, bs):
    graph, eager, _ = runners
    te, reqs = replay_matches_eager(graph, eager, bs, ATOL)
    assert not graph.fallback_counts
    # Both read the cache through the C++ operator, not the torch fallback.
    for handle in reqs:
        ops = decode_ops(lambda h=handle: h.decode(te[-1].tolist()))
        assert "airserve::paged_decode_attention_cpu" in ops, sorted(ops)
        handle.release()


def test_float32_cache_differs_but_stays_close(runners):
    _, eager, float32 = runners
    prompts = random_prompts(eager.model_config.vocab_size, [9, 30])
    a, b = Requests(eager, prompts), Requests(float32, prompts)
    tokens = b.prefill_logits.argmax(-1).tolist()
    la, lb = a.decode(tokens), b.decode(tokens)
    diff = (la - lb).abs().max().item()
    assert 1e-6 < diff < 0.1 * lb.abs().max().item(), diff
    a.release()
    b.release()
