"""CPUGraphRunner (inductor) against eager on the same model object.

One compiled runner per page size, shared by the module (compiling is slow on 2 cores):
buckets [1, 4], so bs 1 and 4 replay exactly, 2 and 3 replay padded in bucket 4, 5 runs eager.
"""

from __future__ import annotations

import sys
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
    # float32: under a bf16 large path (--dtype auto on CPUs with bf16) the products round to
    # bf16, and a batch padded into a bucket may take another oneDNN kernel than the eager one
    # (float32-rounding apart), which that rounding can turn into one bf16 step of difference.
    eager = make_runner(tiny_llama_dir, page_size=page, dtype="float32")
    graph = make_runner(tiny_llama_dir, runner_from=eager, page_size=page, dtype="float32",
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


def compile_workers() -> list:
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "compile_worker" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            pass  # gone meanwhile
    return found


def test_compile_workers_are_gone_after_capture(runners):
    """Inductor's compile worker processes (each with its own torch) leave with the capture."""
    import psutil

    _, alive = psutil.wait_procs(compile_workers(), timeout=10)
    assert not alive, [p.cmdline() for p in alive]


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


# Frames that run when dynamo handles a call: the entry of every torch.compile'd function, its
# guard code, and the decode step itself (the transformed forward_static dynamo runs).
DYNAMO_STEP_FRAMES = ("compile_wrapper", "forward_static")


def dynamo_frames(fn, *args) -> tuple[list[str], object]:
    """Names of the DYNAMO_STEP_FRAMES functions and of any torch/_dynamo/guards.py function
    that run during `fn(*args)`, and its result."""
    seen: list[str] = []

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and (any(name in code.co_name for name in DYNAMO_STEP_FRAMES)
                                or code.co_filename.replace("\\", "/").endswith(
                                    "torch/_dynamo/guards.py")):
            seen.append(code.co_name)

    sys.setprofile(profile)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(None)
    return seen, result


def replays(gr: CPUGraphRunner, bs: int, static, n: int) -> list[torch.Tensor]:
    return [gr.replay_bucket(bs, static).clone() for _ in range(n)]


@torch.inference_mode()
def test_replay_calls_the_compiled_graph_without_dynamo(runners):
    """After a bucket's first replay (through dynamo, checking its inputs) no dynamo code runs
    per step, and the direct call gives what the dynamo-called graph gives."""
    graph, _ = runners
    gr = graph.graph_runner
    for bs in BUCKETS:
        static = gr.inputs.batches[bs]
        gr.attn_backend.init_forward_metadata_capture(static, bs)
        gr.replay_bucket(bs, static)  # the first replay of a bucket may go through dynamo
        assert bs in gr.direct, gr.report().get("direct_replay_refused")
        before = gr.dynamo_replays
        frames, direct = dynamo_frames(replays, gr, bs, static, 3)
        assert frames == []
        assert gr.dynamo_replays == before
        # The probe's names are real: the torch.compile'd function a dynamo replay enters is
        # compile_wrapper (profiling that replay itself is not possible: dynamo does not look
        # up its cache while a profile function is set).
        assert gr.compiled[bs].__code__.co_name in DYNAMO_STEP_FRAMES
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            ref = gr.compiled[bs](static)
        assert gr.dynamo_replays == before
        for out in direct:
            torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert gr.report()["direct_replay_buckets"] == sorted(BUCKETS)
    assert gr.recompiles_since_capture() == 0
