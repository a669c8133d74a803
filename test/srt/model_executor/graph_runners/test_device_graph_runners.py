"""CudaGraphRunner and NPUGraphRunner.

On CPU their device-independent logic runs with a fake device module whose "graphs" re-run the
captured step on replay; the real-hardware tests skip cleanly where there is no GPU or NPU.
"""

from __future__ import annotations

import contextlib
import shutil
import types

import pytest
import torch

from airserve.srt.model_executor.graph_runners.cuda import WARMUP_RUNS, CudaGraphRunner
from airserve.srt.model_executor.graph_runners.npu import NPUGraphRunner
from airserve.srt.model_executor.model_runner import ModelRunner
from airserve.srt.server_args import ServerArgs
from airserve_testing.decode_driver import Requests, make_runner, random_prompts, run_side_by_side
from airserve_testing.tiny_models import make_tiny_model_dir

ATOL = 1e-4  # float32; a padded batch changes only GEMM blocking on CPU


class FakeGraph:
    """Replays by re-running the step it was given after capture."""

    def __init__(self):
        self.fn = None
        self.replays = 0
        self.updates = []

    def replay(self):
        self.replays += 1
        self.fn()

    def update(self, cpu_update_input):
        self.updates.append(cpu_update_input)


def fake_device_module():
    return types.SimpleNamespace(
        Stream=lambda: "stream", graph_pool_handle=lambda: "pool",
        stream=lambda s: contextlib.nullcontext(), synchronize=lambda: None,
        mem_get_info=lambda: (0, 0))


class FakeDevice:
    """Mixin replacing the vendor calls; counts forward calls made during capture."""

    def get_device_module(self):
        return fake_device_module()

    def create_graph(self):
        return FakeGraph()

    def graph_context(self, graph):
        self.contexts = getattr(self, "contexts", []) + [(graph, self.pool, self.stream)]
        return contextlib.nullcontext()

    def forward_static(self, fb):
        self.forward_calls = getattr(self, "forward_calls", 0) + 1
        return super().forward_static(fb)

    def capture_bucket(self, bs, fb):
        super().capture_bucket(bs, fb)
        out = self.outputs[bs]
        self.graphs[bs].fn = lambda: out.copy_(self.forward_static(fb))


class FakeCudaRunner(FakeDevice, CudaGraphRunner):
    pass


class FakeNPURunner(FakeDevice, NPUGraphRunner):
    pass


# float32 on the host: under a bf16 large path a batch padded into a bucket may round one bf16
# step apart from the eager batch (test_cpu_graph_runner.py says why).
@pytest.fixture(scope="module")
def eager(tiny_llama_dir):
    return make_runner(tiny_llama_dir, page_size=4, dtype="float32")


def with_runner(model_path, eager, cls, **kwargs):
    runner = make_runner(model_path, runner_from=eager, page_size=4, cuda_graph_bs=(2, 4),
                         dtype="float32", **kwargs)
    runner.graph_runner = cls(runner)
    return runner


def test_cuda_runner_logic(tiny_llama_dir, eager):
    runner = with_runner(tiny_llama_dir, eager, FakeCudaRunner)
    gr = runner.graph_runner
    # One pool and one stream for every graph; warm-up runs before each capture.
    assert [(p, s) for _, p, s in gr.contexts] == [("pool", "stream")] * 2
    assert gr.forward_calls == 2 * (WARMUP_RUNS + 1)
    prompts = random_prompts(runner.model_config.vocab_size, [5, 9, 12])
    lg, le, tg, te, reqs = run_side_by_side(runner, eager, prompts, steps=5)
    torch.testing.assert_close(lg, le, atol=ATOL, rtol=0)
    assert gr.graphs[4].replays == 5 and gr.graphs[2].replays == 0
    # The graph's output buffer is reused by the next replay: callers get a copy.
    out = reqs[0].decode([1, 2, 3])
    assert out.data_ptr() != gr.outputs[4].data_ptr()
    for r in reqs:
        r.release()


def test_cuda_runner_compiles_inside_the_graph_up_to_torch_compile_max_bs(tiny_llama_dir,
                                                                           eager):
    runner = with_runner(tiny_llama_dir, eager, FakeCudaRunner, enable_torch_compile=True,
                         torch_compile_backend="eager", torch_compile_max_bs=2)
    gr = runner.graph_runner
    assert gr.forward_for_bucket(4) == gr.forward_static  # above the limit: not compiled
    assert gr.forward_for_bucket(2) != gr.forward_static
    reqs = Requests(runner, random_prompts(runner.model_config.vocab_size, [5, 6]))
    ref = Requests(eager, random_prompts(runner.model_config.vocab_size, [5, 6]))
    torch.testing.assert_close(reqs.decode([1, 2]), ref.decode([1, 2]), atol=ATOL, rtol=0)
    reqs.release()
    ref.release()


def test_npu_runner_updates_host_seq_lens_on_every_replay(tiny_llama_dir, eager):
    runner = with_runner(tiny_llama_dir, eager, FakeNPURunner)
    gr = runner.graph_runner
    prompts = random_prompts(runner.model_config.vocab_size, [5, 9, 12])
    reqs = Requests(runner, prompts)
    ref = Requests(eager, prompts)
    for step in range(3):
        torch.testing.assert_close(reqs.decode([1, 2, 3]), ref.decode([1, 2, 3]), atol=ATOL,
                                   rtol=0)
        # Real lengths, then 1 for the padded row of bucket 4.
        lens = [6 + step, 10 + step, 13 + step, 1]
        assert gr.graphs[4].updates[-1] == [{"actual_seq_lengths_kv": lens}]
    reqs.release()
    ref.release()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("compile_", [False, True])
def test_cuda_graphs_match_eager_on_gpu(tiny_llama_dir, compile_):
    eager_gpu = make_runner(tiny_llama_dir, device="cuda", page_size=16,
                            disable_cuda_graph=True)
    graph = make_runner(tiny_llama_dir, runner_from=eager_gpu, device="cuda", page_size=16,
                        cuda_graph_bs=(1, 4), enable_torch_compile=compile_)
    assert isinstance(graph.graph_runner, CudaGraphRunner)
    prompts = random_prompts(graph.model_config.vocab_size, [5, 23, 40])
    lg, le, tg, te, _ = run_side_by_side(graph, eager_gpu, prompts, steps=30)
    torch.testing.assert_close(lg, le, atol=1e-3, rtol=0)
    assert torch.equal(tg, te)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("compile_", [False, True])
def test_cuda_graphs_bf16_64_wide_heads_at_batch_64(tmp_path_factory, compile_):
    """bf16, 64-wide heads, 64 rows: SDPA takes cuDNN's attention there, which cannot allocate
    inside a capture; the warm-up runs must take the captured shapes so that it sets up before.
    (Capture at bucket 64 failed with CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED on an
    H200 when warm-up read only the live columns.)"""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("bf16_heads64"), "llama",
                               hidden_size=256, intermediate_size=512, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64)
    args = ServerArgs(model_path=path, device="cuda", dtype="bfloat16", max_total_tokens=4096,
                      max_running_requests=64, page_size=16, disable_cuda_graph=True)
    eager_gpu = ModelRunner(args)
    graph = ModelRunner(args.replace(disable_cuda_graph=False, cuda_graph_bs=(1, 64),
                                     enable_torch_compile=compile_, torch_compile_max_bs=64),
                        model_config=eager_gpu.model_config, model=eager_gpu.model)
    assert isinstance(graph.graph_runner, CudaGraphRunner)
    assert sorted(graph.graph_runner.graphs) == [1, 64]
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(3, 40, (64,), generator=g).tolist()
    prompts = random_prompts(graph.model_config.vocab_size, lengths)
    lg, le, _, _, reqs = run_side_by_side(graph, eager_gpu, prompts, steps=4)
    # The graph reads every block-table column under a mask, eager only the live ones: bf16
    # sums in another order, so equal up to bf16 rounding of the logits.
    assert (lg.float() - le.float()).abs().max() <= 0.03 * le.float().abs().max()
    assert graph.graph_replays == 4 and not graph.fallback_counts
    for r in reqs:
        r.release()


@pytest.mark.npu
@pytest.mark.skipif(shutil.which("npu-smi") is None, reason="needs an Ascend NPU with CANN")
def test_npu_graphs_match_eager_on_npu(tiny_llama_dir):
    eager_npu = make_runner(tiny_llama_dir, device="npu", disable_cuda_graph=True)
    graph = make_runner(tiny_llama_dir, runner_from=eager_npu, device="npu",
                        cuda_graph_bs=(1, 4))
    assert isinstance(graph.graph_runner, NPUGraphRunner)
    prompts = random_prompts(graph.model_config.vocab_size, [5, 23, 40])
    lg, le, tg, te, _ = run_side_by_side(graph, eager_npu, prompts, steps=30)
    torch.testing.assert_close(lg, le, atol=1e-2, rtol=0)
    assert torch.equal(tg, te)
