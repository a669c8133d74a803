"""CPUGraphRunner (inductor) against eager on the same model object.

One compiled runner per page size, shared by the module (compiling is slow on 2 cores):
buckets [1, 4], so bs 1 and 4 replay exactly, 2 and 3 replay padded in bucket 4, 5 runs eager.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from airserve.srt.layers import cpu_kernels
from airserve.srt.layers.attention import torch_native_backend
from airserve.srt.mem_cache.memory_pool import DUMMY_SLOT
from airserve.srt.model_executor.graph_runners.base import dynamo_graph_count
from airserve.srt.model_executor.graph_runners.cpu import CPUGraphRunner
from airserve_testing import Requests, make_runner, random_prompts, run_side_by_side, zero_kv

# float32 on both sides; inductor fuses and reorders reductions, nothing else differs.
ATOL = 1e-4
BUCKETS = (1, 4)


@pytest.fixture(scope="module", params=[1, 16], ids=["page1", "page16"])
def runners(request, tiny_llama_dir):
    page = request.param
    eager = make_runner(tiny_llama_dir, page_size=page)
    graph = make_runner(tiny_llama_dir, runner_from=eager, page_size=page,
                        enable_torch_compile=True, cuda_graph_bs=BUCKETS)
    assert isinstance(graph.graph_runner, CPUGraphRunner)
    return graph, eager


@pytest.mark.parametrize("bs", [1, 2, 3, 4])
def test_30_decode_steps_match_eager_logits_and_kv(runners, bs):
    graph, eager = runners
    zero_kv(graph)
    zero_kv(eager)
    replays = graph.graph_runner.replay_count
    # Lengths chosen so 30 steps cross page boundaries at page size 16 (and every step at 1).
    prompts = random_prompts(graph.model_config.vocab_size, [5, 23, 40, 14][:bs])
    lg, le, tg, te, reqs = run_side_by_side(graph, eager, prompts, steps=30)
    assert graph.graph_runner.replay_count == replays + 30
    torch.testing.assert_close(lg, le, atol=ATOL, rtol=0)
    assert torch.equal(tg, te)
    pools = zip(graph.kv_cache.k_buffers + graph.kv_cache.v_buffers,
                eager.kv_cache.k_buffers + eager.kv_cache.v_buffers)
    for g, e in pools:
        # Everything but the dummy slot equals eager: padded rows wrote nowhere else.
        torch.testing.assert_close(g[DUMMY_SLOT + 1:], e[DUMMY_SLOT + 1:], atol=ATOL, rtol=0)
    if bs in BUCKETS:  # no padded rows: the dummy slot is untouched
        assert not graph.kv_cache.k_buffers[0][DUMMY_SLOT].any()
    else:
        assert graph.kv_cache.k_buffers[0][DUMMY_SLOT].any()  # padded rows ran
    for r in reqs:
        r.release()


def test_larger_batch_runs_eager_and_is_counted(runners):
    graph, eager = runners
    before = sum(graph.fallback_counts.values())
    replays = graph.graph_runner.replay_count
    prompts = random_prompts(graph.model_config.vocab_size, [6, 7, 8, 9, 10])
    lg, le, tg, te, reqs = run_side_by_side(graph, eager, prompts, steps=4)
    assert torch.equal(tg, te)
    torch.testing.assert_close(lg, le, atol=0, rtol=0)  # literally the eager path
    assert graph.graph_runner.replay_count == replays
    assert sum(graph.fallback_counts.values()) == before + 4
    assert any("largest captured bucket 4" in reason for reason in graph.fallback_counts)
    for r in reqs:
        r.release()


def test_kv_writes_stay_in_place_under_inductor(runners):
    """Inductor must hand the op the pool itself, not a copy it writes back (that would cost a
    whole-pool copy per step). Spies on the op the compiled graph calls: the float32 C++
    decode-attention op, whose CPU kernel is swapped for a recording one running the torch
    reference (restored when the temporary library is destroyed)."""
    graph, _ = runners
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    seen = []

    def spy(q, k, v, k_cache, v_cache, *args):
        seen.append((k_cache.data_ptr(), v_cache.data_ptr()))
        return torch_native_backend.paged_decode_attention_kernel(q, k, v, k_cache, v_cache,
                                                                  *args)

    lib = torch.library.Library("airserve", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            lib.impl("paged_decode_attention_cpu", spy, "CPU")
        reqs = Requests(graph, random_prompts(graph.model_config.vocab_size, [7, 9, 11]))
        seen.clear()  # prefill is eager and does not call the decode op anyway
        replays = graph.graph_runner.replay_count
        reqs.decode([1, 2, 3])
    finally:
        lib._destroy()
    assert graph.graph_runner.replay_count == replays + 1
    cache = graph.kv_cache
    assert seen == [(k.data_ptr(), v.data_ptr())
                    for k, v in zip(cache.k_buffers, cache.v_buffers)]
    reqs.release()


def test_no_recompile_after_capture(runners):
    """Dynamo's graph counter must not move across decode steps of every bucket and varied
    live lengths (a recompile would stall a step for seconds, or silently run eager)."""
    graph, _ = runners
    gr = graph.graph_runner
    before = dynamo_graph_count()
    for lengths in ([3], [30, 4], [8, 9, 10], [50, 2, 3, 4]):
        reqs = Requests(graph, random_prompts(graph.model_config.vocab_size, lengths))
        for _ in range(3):
            reqs.decode([1] * len(lengths))
        reqs.release()
    assert dynamo_graph_count() == before
    assert gr.recompiles_since_capture() == 0
    assert gr.report()["recompiles_since_capture"] == 0
