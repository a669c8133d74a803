"""The shared GraphRunner logic with a recording runner that replays eagerly: no compiler.

Padding, inert padded rows, output slicing, fallback rules and the report are checked here once
for every runner (CPU, CUDA, NPU, and the compile runners that reuse the base class).
"""

from __future__ import annotations

import sys

import pytest
import torch

from airserve.srt.forward_batch import ForwardBatch, ForwardMode
from airserve.srt.mem_cache.memory_pool import DUMMY_PAGE, DUMMY_SLOT
from airserve.srt.model_executor.graph_runners.base import GraphCaptureError, GraphRunner
from airserve_testing.decode_driver import Requests, make_runner, random_prompts

# Eager over a padded static batch vs eager over the real batch: float32, only the GEMM blocking
# for a different row count differs.
ATOL = 1e-4


class RecordingRunner(GraphRunner):
    """Captures nothing; replays `forward_static` and records what each replay saw."""

    def capture_bucket(self, bs: int, fb: ForwardBatch) -> None:
        self.captured = getattr(self, "captured", []) + [bs]

    def replay_bucket(self, bs: int, fb: ForwardBatch) -> torch.Tensor:
        self.seen = dict(bs=bs, input_ids=fb.input_ids.clone(), positions=fb.positions.clone(),
                         seq_lens=fb.seq_lens.clone(), seq_lens_cpu=list(fb.seq_lens_cpu),
                         out_cache_loc=fb.out_cache_loc.clone(),
                         block_table=fb.attn_metadata.clone())
        return self.forward_static(fb)


@pytest.fixture(scope="module")
def runners(tiny_llama_dir):
    eager = make_runner(tiny_llama_dir, page_size=4)
    graph = make_runner(tiny_llama_dir, runner_from=eager, page_size=4,
                        cuda_graph_bs=(1, 2, 4, 8))
    graph.graph_runner = RecordingRunner(graph)
    return graph, eager


def test_capture_walks_largest_bucket_first(runners):
    graph, _ = runners
    assert graph.graph_runner.captured == [8, 4, 2, 1]
    assert graph.graph_runner.input_ids.shape == (8,)


@pytest.mark.parametrize("bs", [1, 3, 5, 8])
def test_padded_rows_are_inert_and_outputs_sliced(runners, bs):
    graph, eager = runners
    gr = graph.graph_runner
    prompts = random_prompts(graph.model_config.vocab_size, [3 + 2 * i for i in range(bs)])
    rg, re_ = Requests(graph, prompts), Requests(eager, prompts)
    tokens = [1] * bs
    for _ in range(6):  # crosses page boundaries (page size 4)
        lg, le = rg.decode(tokens), re_.decode(tokens)
        assert lg.shape == le.shape == (bs, graph.model_config.vocab_size)
        torch.testing.assert_close(lg, le, atol=ATOL, rtol=0)
        tokens = le.argmax(-1).tolist()
    seen = gr.seen
    bucket = gr.bucket_for(bs)
    assert seen["bs"] == bucket
    pad = slice(bs, bucket)
    # Padded rows write only the dummy slot and read only the dummy page.
    assert (seen["out_cache_loc"][pad] == DUMMY_SLOT).all()
    assert (seen["block_table"][pad] == DUMMY_PAGE).all()
    assert (seen["seq_lens"][pad] == 1).all() and (seen["positions"][pad] == 0).all()
    assert seen["seq_lens_cpu"] == rg.lens + [1] * (bucket - bs)
    assert seen["block_table"].shape[1] == -(-graph.context_len // 4)  # full width, padded
    # Live rows see their own inputs.
    assert seen["seq_lens"][:bs].tolist() == rg.lens
    rg.release()
    re_.release()


def test_kv_pools_match_eager_outside_the_dummy_slot(runners):
    graph, eager = runners
    for g, e in zip(graph.kv_cache.k_buffers + graph.kv_cache.v_buffers,
                    eager.kv_cache.k_buffers + eager.kv_cache.v_buffers):
        torch.testing.assert_close(g[DUMMY_SLOT + 1:], e[DUMMY_SLOT + 1:], atol=ATOL, rtol=0)


def test_fallback_reasons(runners):
    graph, _ = runners
    gr = graph.graph_runner
    prompts = random_prompts(graph.model_config.vocab_size, [4] * 9)
    reqs = Requests(graph, prompts)
    before = sum(graph.fallback_counts.values())
    reqs.decode([1] * 9)  # 9 > largest bucket 8: eager, counted
    assert sum(graph.fallback_counts.values()) == before + 1
    assert any("9 > largest captured bucket 8" in r for r in graph.fallback_counts)
    reqs.release()
    assert gr.fallback_reason(reqs_batch(graph, 3)) is None
    gr.padding = False
    try:
        assert "exactly 3" in gr.fallback_reason(reqs_batch(graph, 3))
        assert gr.fallback_reason(reqs_batch(graph, 4)) is None
    finally:
        gr.padding = True


def reqs_batch(runner, bs: int):
    return runner.make_forward_batch(
        ForwardMode.DECODE, input_ids=[1] * bs, positions=[1] * bs,
        req_pool_indices=list(range(bs)), seq_lens=[2] * bs,
        out_cache_loc=torch.zeros(bs, dtype=torch.int64))


def test_prefill_is_not_replayed(runners):
    graph, _ = runners
    count = graph.graph_runner.replay_count
    reqs = Requests(graph, random_prompts(graph.model_config.vocab_size, [5, 6]))
    assert graph.graph_runner.replay_count == count
    assert "not a decode batch" not in graph.fallback_counts  # prefill is not a fallback
    reqs.release()


def test_report(runners):
    report = runners[0].graph_runner.report()
    assert report["runner"] == "RecordingRunner"
    assert report["buckets"] == [1, 2, 4, 8]
    assert set(report["capture_seconds"]) == {1, 2, 4, 8}
    assert report["replay_count"] > 0 and report["memory_bytes"] >= 0


def test_capture_failure_is_one_error_naming_the_fixes(tiny_llama_dir):
    class Failing(RecordingRunner):
        def capture_bucket(self, bs, fb):
            raise MemoryError("out of memory")

    runner = make_runner(tiny_llama_dir, cuda_graph_bs=(1, 2))
    with pytest.raises(GraphCaptureError) as info:
        Failing(runner)
    msg = str(info.value)
    for fix in ("--cuda-graph-max-bs", "--cuda-graph-bs", "--disable-cuda-graph",
                "--enable-torch-compile", "batch size 2"):
        assert fix in msg
    assert isinstance(info.value.__cause__, MemoryError)


@pytest.mark.skipif(sys.platform != "linux", reason="malloc_trim is glibc's")
def test_trim_heap_returns_freed_pages_below_a_live_chunk():
    """What capture does after compiling: 256 MiB freed below a chunk still held stays in the
    process until trim_heap hands its pages back."""
    import ctypes

    import psutil

    from airserve.srt.model_executor.graph_runners.base import trim_heap

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    size = 64 << 10  # under glibc's mmap threshold: heap chunks
    chunks = [libc.malloc(size) for _ in range(4096)]
    pin = libc.malloc(size)  # above them: the heap's top cannot shrink past it
    for c in chunks:
        libc.memset(c, 1, size)
    for c in chunks:
        libc.free(c)
    held = psutil.Process().memory_info().rss
    assert trim_heap()
    trimmed = psutil.Process().memory_info().rss
    libc.free(pin)
    assert held - trimmed > 128 << 20, (held, trimmed)
