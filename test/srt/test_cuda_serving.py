"""Serving on an NVIDIA GPU, end to end: the scheduler, radix cache, chunked prefill and CUDA
graphs on the tiny Llama, and the HTTP server with `--device cuda`.

Every test here needs a GPU and skips cleanly without one. References are eager runs on the same
GPU (`disable_cuda_graph=True`); float32 weights keep greedy tokens comparable bit for bit
between a captured graph and eager launches of the same kernels.
"""

from __future__ import annotations

import pytest
import torch

from airserve import Engine
from airserve.srt.model_executor.graph_runners.cuda import CudaGraphRunner
from airserve_testing.server_utils import ServerProcess

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
LENGTHS = (5, 17, 40, 3, 64, 9)


def prompts_for(engine: Engine) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    vocab = engine.model_runner.model_config.vocab_size
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def outputs(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def eager(tiny_llama_dir):
    eng = Engine(model_path=tiny_llama_dir, device="cuda", dtype="float32",
                 disable_cuda_graph=True, max_total_tokens=4096, max_running_requests=8)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def reference(eager):
    prompts = prompts_for(eager)
    return prompts, outputs(eager, prompts)


@pytest.mark.parametrize("extra", [
    {},  # CUDA graphs, radix cache, default chunking
    {"disable_radix_cache": True, "chunked_prefill_size": 7, "page_size": 4},
    {"chunked_prefill_size": 16, "enable_mixed_chunk": True, "page_size": 16},
], ids=["graphs", "chunks7-nocache", "chunks16-mixed"])
def test_engine_on_cuda_matches_eager(tiny_llama_dir, reference, extra):
    prompts, want = reference
    eng = Engine(model_path=tiny_llama_dir, device="cuda", dtype="float32",
                 max_total_tokens=4096, max_running_requests=8, **extra)
    try:
        assert isinstance(eng.model_runner.graph_runner, CudaGraphRunner)
        assert outputs(eng, prompts) == want
        # A second pass over the same prompts hits the radix cache where it is on.
        again = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in again] == want
        cached = sum(o["meta_info"]["cached_tokens"] for o in again)
        if extra.get("disable_radix_cache"):
            assert cached == 0
        else:
            assert cached > 0
        # Decode steps replay graphs; none ran eager (mixed steps are extends, not fallbacks).
        assert eng.model_runner.graph_replays > 0
        assert not eng.model_runner.fallback_counts
    finally:
        eng.shutdown()


def test_server_on_cuda_matches_engine(tiny_llama_dir, reference):
    prompts, want = reference
    srv = ServerProcess(tiny_llama_dir, "--device", "cuda", "--dtype", "float32",
                        "--max-total-tokens", "4096").wait_ready()
    try:
        with srv.client() as c:
            r = c.post("/generate", json={"input_ids": prompts, "sampling_params": GREEDY})
            assert r.status_code == 200, r.text
            assert [o["output_ids"] for o in r.json()] == want
            chat = c.post("/v1/chat/completions", json={
                "model": "default", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "hello"}]})
            assert chat.status_code == 200, chat.text
            assert chat.json()["usage"]["completion_tokens"] > 0
            info = c.get("/get_server_info").json()
            assert info["device"].startswith("cuda")
            assert info["graph_runner"]["runner"] == "CudaGraphRunner"
            assert info["graph_runner"]["replay_count"] > 0 and not info["eager_fallbacks"]
    finally:
        assert srv.stop() == 0
