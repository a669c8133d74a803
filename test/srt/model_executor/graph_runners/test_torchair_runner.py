"""TorchAirRunner on CPU: the runner code that runs on an Ascend NPU, with the compiler swapped
through its seam (inductor, or a backend that records every FX graph) for torchair's.

Tolerance: float32 on both sides; compiled and eager differ only in summation order (seen
below 1e-5), so logits and KV must agree to ATOL and greedy tokens exactly.
"""

from __future__ import annotations

import importlib.util
import itertools
import socket
import subprocess
import sys

import pytest
import torch

from airserve.srt.layers.attention.ascend_backend import AscendAttnBackend
from airserve.srt.model_executor.graph_runners.torchair.runner import (
    TorchAirRunner,
    check_static_tensor_inputs,
)
from airserve.srt.model_executor.model_runner import ModelRunner
from airserve.srt.server_args import ServerArgs
from airserve_testing import Requests, make_runner, random_prompts, run_side_by_side, zero_kv
from airserve_testing.fia_reference import ReferenceAttentionOps

ATOL = 1e-4
PROMPT_LENGTHS = [5, 23, 40, 17]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models: OpenMP threads on a small shared machine cost more than they give.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Recorder:
    """A torch.compile backend that keeps each FX graph and its example inputs, runs eager."""

    def __init__(self) -> None:
        self.graphs: list[tuple[torch.fx.GraphModule, list]] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append((gm, list(example_inputs)))
        return gm.forward

    def inputs(self, i: int) -> dict[str, object]:
        """Placeholder name -> example input of graph i."""
        gm, examples = self.graphs[i]
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        return dict(zip(names, examples))


def compiled_runner(eager: ModelRunner, backend, page_size: int, buckets: tuple[int, ...],
                    ascend: bool = False) -> ModelRunner:
    """A ModelRunner sharing `eager`'s model whose decode runs in a TorchAirRunner."""
    mr = make_runner(eager.server_args.model_path, runner_from=eager, page_size=page_size,
                     torch_compile_max_bs=max(buckets), cuda_graph_bs=buckets,
                     dtype=eager.server_args.dtype)
    if ascend:
        mr.attn_backend = AscendAttnBackend(mr.allocator, mr.context_len,
                                            ops=ReferenceAttentionOps())
    mr.graph_runner = TorchAirRunner(mr, compile_backend=backend)
    return mr


def assert_kv_close(a: ModelRunner, b: ModelRunner) -> None:
    """Both pools beyond the dummy page (which only padded graph rows write)."""
    p = a.kv_cache.page_size
    for x, y in zip(a.kv_cache.k_buffers + a.kv_cache.v_buffers,
                    b.kv_cache.k_buffers + b.kv_cache.v_buffers):
        torch.testing.assert_close(x[p:], y[p:], atol=ATOL, rtol=0)


# Inductor through the seam: replay == eager.
@pytest.fixture(scope="module", params=[16, 128], ids=lambda p: f"page{p}")
def inductor_pair(request, tiny_llama_dir):
    eager = make_runner(tiny_llama_dir, page_size=request.param)
    return compiled_runner(eager, "inductor", request.param, (1, 4)), eager


@pytest.mark.parametrize("batch", [1, 3, 4], ids=lambda n: f"bs{n}")  # bucket 1, 4 padded, 4
def test_inductor_replay_matches_eager_for_30_steps(inductor_pair, batch):
    compiled, eager = inductor_pair
    zero_kv(compiled)
    zero_kv(eager)
    replays = compiled.graph_replays
    prompts = random_prompts(eager.model_config.vocab_size, PROMPT_LENGTHS[:batch])
    logits_g, logits_e, tokens_g, tokens_e, reqs = run_side_by_side(compiled, eager, prompts, 30)
    assert compiled.graph_replays - replays == 30 and not compiled.fallback_counts
    torch.testing.assert_close(logits_g, logits_e, atol=ATOL, rtol=0)
    assert torch.equal(tokens_g, tokens_e)
    assert_kv_close(compiled, eager)
    assert compiled.graph_runner.report()["graphs_per_bucket"] == {1: 1, 4: 1}
    for r in reqs:
        r.release()


# A recording backend through the seam: what the compiled graphs receive.
@pytest.fixture(scope="module")
def recorded(tiny_llama_dir):
    eager = make_runner(tiny_llama_dir, page_size=16)
    recorder = Recorder()
    return compiled_runner(eager, recorder, 16, (1, 2, 4)), recorder, eager


def graph_bucket(inputs: dict) -> int:
    return next(v.shape[0] for k, v in inputs.items() if "input_ids" in k)


def test_one_graph_per_bucket(recorded):
    mr, recorder, _ = recorded
    assert sorted(graph_bucket(recorder.inputs(i)) for i in range(len(recorder.graphs))) == \
        [1, 2, 4]
    assert mr.graph_runner.report()["graphs_per_bucket"] == {1: 1, 2: 1, 4: 1}


def test_kv_caches_are_graph_inputs_sharing_the_pool(recorded):
    mr, recorder, _ = recorded
    pool = mr.kv_cache.k_buffers + mr.kv_cache.v_buffers
    for i in range(len(recorder.graphs)):
        tensors = [v for v in recorder.inputs(i).values() if isinstance(v, torch.Tensor)]
        for buf in pool:
            same = [t for t in tensors if t.data_ptr() == buf.data_ptr()
                    and t.shape == buf.shape]
            assert len(same) == 1, "every layer's K and V buffer is one graph input"
            assert same[0].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        # No other input of the pool's size: nothing is a copy of a cache.
        assert sum(t.shape == pool[0].shape for t in tensors) == len(pool)


def test_block_table_input_is_bucket_by_max_blocks(recorded):
    mr, recorder, _ = recorded
    max_blocks = -(-mr.context_len // mr.kv_cache.page_size)
    for i in range(len(recorder.graphs)):
        inputs = recorder.inputs(i)
        table = next(v for k, v in inputs.items() if "block_table" in k)
        assert table.dtype == torch.int32
        assert tuple(table.shape) == (graph_bucket(inputs), max_blocks)


def drive_changing_batches(mr: ModelRunner, steps: int, sizes=(3, 1, 4, 2, 3)) -> None:
    """`steps` decode steps in rounds of 10, each round a new set of requests of another
    batch size and other prompt lengths (so sequence lengths change every step)."""
    vocab = mr.model_config.vocab_size
    for round_, n in zip(range(steps // 10), itertools.cycle(sizes)):
        lengths = [7 + 11 * ((round_ + i) % 5) for i in range(n)]
        reqs = Requests(mr, random_prompts(vocab, lengths, seed=round_))
        tokens = reqs.prefill_logits.argmax(-1).tolist()
        for _ in range(10):
            tokens = reqs.decode(tokens).argmax(-1).tolist()
        reqs.release()


def test_50_steps_changing_lengths_and_sizes_do_not_recompile(recorded):
    mr, recorder, _ = recorded
    graphs, replays = len(recorder.graphs), mr.graph_replays
    drive_changing_batches(mr, 50)
    assert mr.graph_replays - replays == 50 and not mr.fallback_counts
    assert len(recorder.graphs) == graphs
    assert mr.graph_runner.report()["recompiles_since_capture"] == 0


# The ascend backend (CPU stand-in for FIA) through the same runner: the host lengths are
# symbolic graph inputs that feed only the attention op, and never recompile.
@pytest.fixture(scope="module")
def ascend_recorded(tiny_llama_dir):
    # float32 pinned: under --dtype auto a CPU with avx512_bf16 or AMX multiplies in bfloat16,
    # which turns the stand-in attention's float32 rounding differences into bf16-sized ones.
    eager = make_runner(tiny_llama_dir, page_size=16, dtype="float32")
    recorder = Recorder()
    return compiled_runner(eager, recorder, 16, (1, 4), ascend=True), recorder, eager


def test_host_seq_lens_are_symbolic_inputs_of_the_attention_op(ascend_recorded):
    mr, recorder, _ = ascend_recorded
    assert len(recorder.graphs) == 2
    for gm, _examples in recorder.graphs:
        bs = graph_bucket(dict(zip([n.name for n in gm.graph.nodes if n.op == "placeholder"],
                                   _examples)))
        symbols = [n for n in gm.graph.nodes if n.op == "placeholder"
                   and isinstance(n.meta["example_value"], torch.SymInt)]
        assert len(symbols) == bs
        for node in symbols:
            assert {u.target for u in node.users} == {torch.ops.airserve_test.fia_decode.default}


def test_ascend_backend_replay_matches_eager_without_recompiles(ascend_recorded):
    mr, recorder, eager = ascend_recorded
    zero_kv(mr)
    zero_kv(eager)
    prompts = random_prompts(eager.model_config.vocab_size, PROMPT_LENGTHS[:3])
    logits_g, logits_e, tokens_g, tokens_e, reqs = run_side_by_side(mr, eager, prompts, 30)
    torch.testing.assert_close(logits_g, logits_e, atol=ATOL, rtol=0)
    assert_kv_close(mr, eager)
    for r in reqs:
        r.release()
    drive_changing_batches(mr, 50, sizes=(2, 4, 1))
    assert len(recorder.graphs) == 2
    assert mr.graph_runner.report()["recompiles_since_capture"] == 0


def test_a_symbolic_tensor_input_is_a_capture_error():
    def backend(gm, example_inputs):
        check_static_tensor_inputs(gm, 4)
        return gm.forward

    fn = torch.compile(lambda x: x * 2, backend=backend, dynamic=True, fullgraph=True)
    # dynamo wraps backend errors (BackendCompilerFailed); the runner re-raises as capture errors
    with pytest.raises(Exception, match="symbolic shape"):
        fn(torch.ones(4, 3))


# Selection.
def test_selection_picks_torchair_only_with_torch_compile_without_importing_torch_npu():
    # torch_npu / torchair set to None in sys.modules: importing either would raise.
    code = (
        "import sys\n"
        "sys.modules['torch_npu'] = None\n"
        "sys.modules['torchair'] = None\n"
        "from airserve.srt.server_args import ServerArgs\n"
        "from airserve.srt.model_executor.graph_runners.config import RunnerConfig\n"
        "from airserve.srt.model_executor.graph_runners.registry import RUNNERS, "
        "select_runner_name\n"
        "import airserve.srt.model_executor.graph_runners.torchair.runner\n"
        "import airserve.srt.layers.attention.ascend_backend\n"
        "def name(**kw): return select_runner_name(RunnerConfig.from_server_args("
        "ServerArgs(**kw)))\n"
        "on = name(device='npu', enable_torch_compile=True)\n"
        "off = name(device='npu')\n"
        "print(RUNNERS[on][1], RUNNERS[off][1])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["TorchAirRunner", "NPUGraphRunner"]


NO_TORCH_NPU = pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None,
                                  reason="torch-npu is installed here")
NPU_FIX = ("torch-npu", "CANN", "set_env.sh")


@NO_TORCH_NPU
def test_device_npu_fails_fast_naming_cann_and_torch_npu(tiny_llama_dir):
    with pytest.raises(RuntimeError) as err:
        ModelRunner(ServerArgs(model_path=tiny_llama_dir, device="npu",
                               enable_torch_compile=True))
    for needed in NPU_FIX:
        assert needed in str(err.value)


@NO_TORCH_NPU
def test_launch_server_on_npu_exits_with_the_fix(tiny_llama_dir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-m", "airserve.launch_server", "--device", "npu",
         "--enable-torch-compile", "--model-path", tiny_llama_dir, "--port", str(port)],
        capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    for needed in NPU_FIX:
        assert needed in out.stdout + out.stderr
