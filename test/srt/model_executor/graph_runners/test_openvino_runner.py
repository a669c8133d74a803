"""OpenVINORunner against eager decode on a tiny model; the default model's greedy ids.

OpenVINO's CPU device is real here. Compiling is slow on small machines, so the runners are
module-scoped: one eager and one OpenVINO runner per page size, buckets (1, 4), KV-length
buckets 32, 64, 128, ... so 30 decode steps cross KV buckets as well as page boundaries.
"""

from __future__ import annotations

import pytest
import torch

from airserve.srt.model_executor.graph_runners.base import GraphCaptureError
from airserve.srt.model_executor.model_runner import ModelRunner
from airserve.srt.server_args import ServerArgs
from airserve_testing.decode_driver import Requests

try:
    import openvino  # noqa: F401
except ImportError:
    pytest.skip("openvino is not installed (pip install airserve[openvino])",
                allow_module_level=True)

from openvino.frontend.pytorch.torchdynamo import execute as ov_execute  # noqa: E402

from airserve.srt.model_executor.graph_runners.openvino import compile as ov_compile  # noqa: E402
from airserve.srt.model_executor.graph_runners.openvino import runner as openvino_runner  # noqa: E402
from airserve.srt.model_executor.graph_runners.openvino.runner import (  # noqa: E402
    POOL_READERS,
    OpenVINORunner,
    kv_len_buckets,
)

# float32 on both sides: only the summation order differs (observed max ~1e-5).
ATOL = 1e-4
STEPS = 30
PROMPT_LENS = (5, 14, 23, 40)  # 30 steps take them over 16-token pages and 32/64-token buckets
BUCKETS = (1, 4)


def runner_args(path: str, page_size: int, dtype: str = "float32", **kw) -> ServerArgs:
    # float32 unless a test says otherwise: the eager reference's prefill would otherwise take
    # --dtype auto's bfloat16 path on CPUs with avx512_bf16 or AMX (OpenVINO runs float32).
    return ServerArgs(model_path=path, page_size=page_size, max_total_tokens=2048,
                      max_running_requests=4, num_threads=2, dtype=dtype, **kw)


def ov_args(path: str, page_size: int, buckets=BUCKETS, **kw) -> ServerArgs:
    return runner_args(path, page_size, enable_torch_compile=True,
                       torch_compile_backend="openvino", cuda_graph_bs=buckets, **kw)


@pytest.fixture(scope="module")
def small_kv_buckets():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(openvino_runner, "SMALLEST_KV_LEN", 32)
        yield


@pytest.fixture(scope="module", params=[1, 16], ids=["page1", "page16"])
def runners(request, tiny_llama_dir, small_kv_buckets):
    page = request.param
    return ModelRunner(runner_args(tiny_llama_dir, page)), ModelRunner(ov_args(tiny_llama_dir,
                                                                              page))


def prompts_for(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for length in PROMPT_LENS[:n]]


def decode(runner: ModelRunner, prompts: list[list[int]], steps: int,
           forced: list[list[int]] | None = None):
    """Prefill eagerly, then `steps` decode steps (greedy, or feeding `forced` tokens).

    Returns decode logits [steps, n, vocab], the tokens, and each request's K and V over its
    whole sequence [layers, len, KVH, D]. Frees the request slots and pages afterwards."""
    reqs = Requests(runner, prompts)
    first = reqs.prefill_logits.argmax(-1).tolist()
    tokens = [[t] for t in first] if forced is None else [[f[0]] for f in forced]
    logits = []
    for step in range(steps):
        out = reqs.decode([t[-1] for t in tokens])
        logits.append(out.clone())
        nxt = out.argmax(-1).tolist() if forced is None else [f[step + 1] for f in forced]
        for t, x in zip(tokens, nxt):
            t.append(x)
    kv = []
    for slot, n in zip(reqs.slots, reqs.lens):
        where = runner.req_to_token_pool.req_to_token[slot, :n].long()
        kv.append((torch.stack([k[where] for k in runner.kv_cache.k_buffers]),
                   torch.stack([v[where] for v in runner.kv_cache.v_buffers])))
    reqs.release()
    return torch.stack(logits), tokens, kv


def assert_kv_equal(kv_a, kv_b) -> None:
    for (ka, va), (kb, vb) in zip(kv_a, kv_b):
        torch.testing.assert_close(ka, kb, atol=ATOL, rtol=0)
        torch.testing.assert_close(va, vb, atol=ATOL, rtol=0)


# Pure logic.
def test_kv_len_buckets_cover_the_context_in_whole_pages():
    assert kv_len_buckets(8192, 1) == [256, 512, 1024, 2048, 4096, 8192]
    assert kv_len_buckets(8192, 16) == [16, 32, 64, 128, 256, 512]  # blocks of 16 tokens
    assert kv_len_buckets(500, 16, smallest=100) == [7, 13, 25, 32]
    assert kv_len_buckets(100, 1) == [100]


def static_and_dynamic_calls(runner: OpenVINORunner) -> tuple[int, int]:
    graphs = runner.graphs.values()
    return (sum(g.static.calls for g in graphs if g.static), sum(g.dynamic.calls for g in graphs))


# Parity with eager, every bucket, padded sizes, page boundaries, KV buckets.
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_logits_and_kv_cache_match_eager(runners, n):
    """Twice: first with whatever static graphs are ready (a width first seen here runs on the
    dynamic graph until its static one is compiled), then with every width static."""
    eager, ov = runners
    runner: OpenVINORunner = ov.graph_runner
    prompts = prompts_for(n, eager.model_config.vocab_size)
    ref_logits, ref_tokens, ref_kv = decode(eager, prompts, STEPS)
    for _ in range(2):
        replays = ov.graph_replays
        logits, _, kv = decode(ov, prompts, STEPS, forced=ref_tokens)
        assert ov.graph_replays - replays == STEPS and not ov.fallback_counts
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
        assert_kv_equal(kv, ref_kv)
        runner.wait_static()
    before = static_and_dynamic_calls(runner)
    decode(ov, prompts, STEPS, forced=ref_tokens)
    after = static_and_dynamic_calls(runner)
    assert after[0] - before[0] == STEPS and after[1] == before[1]  # static graphs only
    # The last steps ran past the first KV width, on a request of the start-up graph: the
    # graphs were compiled at start-up, one per batch bucket, and never again.
    last = runner.kv_blocks_for(max(PROMPT_LENS[:n]) + STEPS)
    assert last > runner.kv_blocks[0] and (runner.bucket_for(n), last) in runner.graphs
    assert set(runner.compile_seconds) == set(runner.compilers) == set(BUCKETS)
    assert all(c.calls == 1 for c in runner.compilers.values())


def test_one_graph_per_batch_bucket_takes_any_kv_width(runners):
    """The block table's width is a dynamic input of each compiled model, with the width as a
    scalar size input; requests of one model at different widths share it."""
    eager, ov = runners
    runner: OpenVINORunner = ov.graph_runner
    decode(ov, prompts_for(4, eager.model_config.vocab_size), STEPS)
    assert runner.dynamic_kv and runner.trace_blocks == runner.kv_blocks[0]
    for bs, compiler in runner.compilers.items():
        shapes = [i.get_partial_shape() for i in compiler.compiled_model.inputs]
        assert sum(1 for s in shapes if s.is_dynamic) == 1  # the block table, [bs, ?]
        assert sum(1 for s in shapes if s.rank.get_length() == 0) == 1  # its width
        assert "kv_blocks" in compiler.input_plan
        widths = [kv for b, kv in runner.graphs if b == bs]
        assert all(runner.graphs[(bs, kv)].compiler is compiler for kv in widths)
    assert len({kv for _, kv in runner.graphs}) > 1


def test_each_width_is_compiled_again_with_static_shapes(runners):
    """Every (bs, width) pair gets its own static graph (the width a constant), compiled from
    the bucket's converted model without a re-trace, and replay switches to it."""
    eager, ov = runners
    runner: OpenVINORunner = ov.graph_runner
    decode(ov, prompts_for(4, eager.model_config.vocab_size), STEPS)
    runner.wait_static()
    report = runner.report()
    assert report["static_failures"] == 0
    assert set(report["static_requests"]) == set(report["requests"])
    for (bs, kv), graph in runner.graphs.items():
        assert graph.run is graph.static
        shapes = [i.get_partial_shape() for i in graph.static.request.get_compiled_model().inputs]
        assert not any(s.is_dynamic for s in shapes)
        assert all(s.rank.get_length() > 0 for s in shapes)  # no size input left
        assert [bs, kv] in [[d.get_length() for d in s] for s in shapes]  # the block table
        assert graph.compiler.calls == 1  # no re-trace
    assert all(c.calls == 1 for c in runner.compilers.values())


def test_a_failed_static_compile_keeps_the_dynamic_graph(runners, monkeypatch, caplog):
    eager, ov = runners
    runner: OpenVINORunner = ov.graph_runner
    runner.wait_static()
    (bs, kv), graph = next(iter(runner.graphs.items()))
    static, failures = graph.static, runner.static_failures
    graph.static = None

    def fail(self, inputs, sizes):
        raise RuntimeError("no compile today")

    monkeypatch.setattr(ov_compile.OpenVINOCompiler, "specialize", fail)
    try:
        with caplog.at_level("WARNING"):
            runner._specialize(graph, bs, kv)
        assert graph.run is graph.dynamic and runner.static_failures == failures + 1
        assert "no compile today" in caplog.text and "dynamic KV width" in caplog.text
    finally:
        graph.static = static


def test_every_graph_ran_in_openvino_without_recompiles(runners, monkeypatch):
    eager, ov = runners
    calls = []
    real = ov_execute.openvino_execute
    monkeypatch.setattr(ov_execute, "openvino_execute",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    runner: OpenVINORunner = ov.graph_runner
    infers = sum(g.calls for g in runner.graphs.values())
    replays = ov.graph_replays
    decode(ov, prompts_for(3, eager.model_config.vocab_size), 5)
    # One OpenVINO inference per step, on the bound request (not through the stock backend).
    assert sum(g.calls for g in runner.graphs.values()) - infers == 5
    assert ov.graph_replays - replays == 5 and not calls
    report = runner.report()
    assert report["recompiles"] == 0
    assert set(report["compiled_graphs"]) == {"1", "4"}  # start-up: one graph per bs
    assert set(report["requests"]) >= {"1x32", "4x32"} and report["kv_len_dynamic"]
    assert len(report["requests"]) == len(runner.graphs)
    assert set(report["openvino_weights"]) == {"f32"}  # no GGUF blocks: float32 weights
    for graph in runner.graphs.values():
        compiler = graph.compiler
        assert compiler.calls == 1 and not compiler.partition.perm_fallback
        assert list(compiler.compiled_model.get_property("EXECUTION_DEVICES")) == ["CPU"]
        assert graph.dynamic.request.get_compiled_model().inputs == compiler.compiled_model.inputs


def test_kv_pool_inputs_are_only_gathered(runners):
    """The per-step cost cannot grow with the pool: OpenVINO only gathers from it."""
    runner: OpenVINORunner = runners[1].graph_runner
    for graph in runner.graphs.values():
        consumers = graph.compiler.pool_input_consumers(runners[1].kv_pool.num_slots)
        assert consumers and set(consumers) <= POOL_READERS


def test_lost_kv_writes_are_detected(runners, monkeypatch):
    """What the parity test guards against: a runner that drops the graph's K/V."""
    eager, ov = runners
    prompts = prompts_for(2, eager.model_config.vocab_size)
    _, ref_tokens, ref_kv = decode(eager, prompts, 4)
    monkeypatch.setattr(ov.graph_runner, "_write_kv", lambda new_kv, loc: None)
    _, _, kv = decode(ov, prompts, 4, forced=ref_tokens)
    with pytest.raises(AssertionError):
        assert_kv_equal(kv, ref_kv)


# GGUF blocks as OpenVINO compressed weights (--openvino-weights packed, the default).
def test_gguf_blocks_run_as_compressed_weights(tmp_path, small_kv_buckets):
    """Q4_0/Q4_1/Q8_0 layers become u4/i8 matmuls in the compiled model, and decode still
    matches the eager float32 weights (same values; float32 rounding of the zero points)."""
    from airserve_testing.tiny_gguf import PACKED_TYPES, write_tiny_gguf

    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, "llama", qtypes=PACKED_TYPES)
    eager = ModelRunner(runner_args(path, 16, packed_decode_max_bs=0))
    ov = ModelRunner(ov_args(path, 16))
    # q, k, o, gate, up, down (Q4_0/Q4_1) x 2 layers; v (Q8_0) x 2 and the tied lm_head.
    # (OpenVINO may merge matmuls that share an input, so types are checked, not counts.)
    assert set(ov.graph_runner.report()["openvino_weights"]) == {"u4", "i8"}
    assert ov.kernels_report()["packed_layers"] == {}  # the C++ block kernels are not used
    # gate (Q4_1) and up (Q4_0, carried as Q4_1) are one compressed layer; q/k/v one per block
    # kind (q/k Q4_1, v Q8_0).
    from airserve.srt.layers.quant.openvino_linear import ConcatLinear, OpenVINOLinear

    layers = ov.graph_runner.ov_model.model.layers
    assert all(isinstance(la.mlp.gate_up_proj, OpenVINOLinear)
               and isinstance(la.self_attn.qkv_proj, ConcatLinear) for la in layers)
    prompts = prompts_for(3, eager.model_config.vocab_size)
    ref_logits, ref_tokens, ref_kv = decode(eager, prompts, STEPS)
    logits, _, kv = decode(ov, prompts, STEPS, forced=ref_tokens)
    assert ov.graph_replays == STEPS and not ov.fallback_counts
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert_kv_equal(kv, ref_kv)
    ov.graph_runner.wait_static()  # the compressed weights in the static graphs too
    assert all(g.static for g in ov.graph_runner.graphs.values())
    logits, _, kv = decode(ov, prompts, STEPS, forced=ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert_kv_equal(kv, ref_kv)

    flt = ModelRunner(ov_args(path, 16, buckets=(4,), openvino_weights="float"))
    assert set(flt.graph_runner.report()["openvino_weights"]) == {"f32"}
    # int8 activations: the Q4_1 minimum moves to a float16 matmul; logits close, not equal.
    dq = ModelRunner(ov_args(path, 16, buckets=(4,), openvino_dynamic_quant_group_size=32))
    assert set(dq.graph_runner.report()["openvino_weights"]) == {"u4", "i8", "f16"}
    logits, _, _ = decode(dq, prompts, 4, forced=ref_tokens)
    ref = ref_logits[:4]
    # Measured 0.055 on this random 64-wide model; wrong weights or layouts give ~1.
    assert 0 < (logits - ref).norm() / ref.norm() < 0.15


# No silent fallback.
def test_op_openvino_cannot_run_is_a_startup_error(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(OpenVINORunner, "disabled_ops", ("torch.ops.aten.mm.default",))
    with pytest.raises(GraphCaptureError, match=r"would run in PyTorch: .*aten\.mm"):
        ModelRunner(ov_args(tiny_llama_dir, 1, buckets=(1,)))


def test_conversion_failure_is_a_startup_error(tiny_llama_dir, monkeypatch):
    from openvino.frontend.pytorch.torchdynamo import partition

    def fail(self, gm, options):
        raise RuntimeError("simulated conversion failure")

    monkeypatch.setattr(partition.Partitioner, "make_partitions", fail)
    with pytest.raises(GraphCaptureError, match="could not compile.*simulated conversion"):
        ModelRunner(ov_args(tiny_llama_dir, 1, buckets=(1,)))


def test_openvino_runtime_failure_is_an_error(tiny_llama_dir, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("simulated plugin failure")

    # What the stock backend calls to compile its partition (in place of its own
    # openvino_compile): it fails inside the backend's run, which switches to eager PyTorch.
    monkeypatch.setattr(ov_compile, "_compile_partition", fail)
    with pytest.raises(GraphCaptureError, match="eager PyTorch.*simulated plugin failure"):
        ModelRunner(ov_args(tiny_llama_dir, 1, buckets=(1,)))


# Devices and installation.
@pytest.mark.parametrize("device, missing", [("GPU.7", "GPU"), ("NPU", "NPU")])
def test_absent_device_is_an_error_naming_what_is_missing(tiny_llama_dir, device, missing):
    import openvino

    if any(d.startswith(missing) for d in openvino.Core().available_devices):
        pytest.skip(f"this machine has an OpenVINO {missing}")
    with pytest.raises(RuntimeError) as e:
        ModelRunner(ov_args(tiny_llama_dir, 1, openvino_device=device))
    msg = str(e.value)
    assert f"--openvino-device {device} is not available" in msg
    assert "OpenVINO devices here: CPU" in msg
    assert ("libOpenCL" in msg or "/dev/dri" in msg) if missing == "GPU" else "/dev/accel" in msg


def test_without_openvino_the_error_says_how_to_install(tiny_llama_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "openvino", None)
    with pytest.raises(RuntimeError, match=r"pip install openvino==2026\.4\.1"):
        ModelRunner(ov_args(tiny_llama_dir, 1))


def cpu_can(capability: str) -> bool:
    import openvino

    return capability in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


@pytest.mark.parametrize("precision,dtype", [("bf16", "auto"), ("f16", "float16")])
def test_a_precision_the_cpu_lacks_is_refused(tiny_llama_dir, precision, dtype):
    """On a CPU without bf16/f16 arithmetic the plugin would silently compute in f32."""
    if cpu_can({"bf16": "BF16", "f16": "FP16"}[precision]):
        pytest.skip(f"this CPU computes in {precision}")
    with pytest.raises(ValueError, match=f"cannot compute in {precision}.*f32"):
        ModelRunner(ov_args(tiny_llama_dir, 1, buckets=(1,), dtype=dtype,
                            openvino_precision=precision))


def test_bf16_hint_reaches_the_plugin_and_warns_about_the_float32_pool(tiny_llama_dir, caplog):
    import openvino

    if not cpu_can("BF16"):
        pytest.skip("this CPU has no bf16 arithmetic (test_a_precision_the_cpu_lacks_is_refused)")
    runner = ModelRunner(ov_args(tiny_llama_dir, 1, buckets=(1,), openvino_precision="bf16"))
    (graph,) = runner.graph_runner.graphs.values()
    compiler = graph.compiler
    assert compiler.compiled_model.get_property("INFERENCE_PRECISION_HINT") == openvino.Type.bf16
    # OpenVINO converts the float32 pool to bf16 before gathering: said at start-up.
    assert "Reorder" in compiler.pool_input_consumers(runner.kv_pool.num_slots)
    assert "reads the whole KV pool" in caplog.text


def test_float16_pool_with_f16_hint_is_only_gathered(tiny_llama_dir, caplog):
    if not cpu_can("FP16"):
        pytest.skip("this CPU has no f16 arithmetic (test_a_precision_the_cpu_lacks_is_refused)")
    runner = ModelRunner(ov_args(tiny_llama_dir, 1, buckets=(1,), dtype="float16",
                                 openvino_precision="f16"))
    (graph,) = runner.graph_runner.graphs.values()
    compiler = graph.compiler
    consumers = compiler.pool_input_consumers(runner.kv_pool.num_slots)
    assert consumers and set(consumers) <= POOL_READERS
    assert "reads the whole KV pool" not in caplog.text


# The default model.
@pytest.mark.slow
def test_default_model_greedy_ids_equal_eager():
    from airserve import Engine

    try:
        # OpenVINO multiplies float32 activations with the blocks; eager's default (auto) would
        # quantize Q4_1 activations to int8 and give other greedy ids.
        # dtype float32: under auto, CPUs with avx512_bf16 or AMX prefill in bfloat16.
        eager = Engine(max_total_tokens=4096, max_running_requests=4, num_threads=2,
                       cpu_decode_activations="float32", dtype="float32")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok = eager.tokenizer
    texts = [
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
        "Question: Tom has 12 apples and gives 5 to Anna. How many are left?\nAnswer:",
        "def fibonacci(n):",
        "The three primary colours are",
    ]
    prompts = [tok.encode(t) for t in texts]
    params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    ref = [o["output_ids"] for o in eager.generate(input_ids=prompts, sampling_params=params)]
    del eager
    ov = Engine(max_total_tokens=4096, max_running_requests=4, num_threads=2,
                enable_torch_compile=True, torch_compile_backend="openvino", cuda_graph_bs=[4])
    out = [o["output_ids"] for o in ov.generate(input_ids=prompts, sampling_params=params)]
    runner = ov.model_runner
    assert runner.graph_replays >= 63 and not runner.fallback_counts
    assert out == ref


def test_start_up_compiles_the_static_widths_up_to_the_flag(tiny_llama_dir, small_kv_buckets):
    """--openvino-static-kv-len: every bucket's requests and static graphs for the KV widths up
    to that many tokens exist when start-up ends (no compile beside the first long requests);
    wider widths are left to first need. The default compiles the first width alone."""
    ov = ModelRunner(ov_args(tiny_llama_dir, 1, buckets=(1, 2), openvino_static_kv_len=64))
    runner: OpenVINORunner = ov.graph_runner
    assert runner.kv_blocks[:3] == [32, 64, 128]
    assert sorted(runner.graphs) == [(1, 32), (1, 64), (2, 32), (2, 64)]
    assert all(g.run is g.static for g in runner.graphs.values())  # ready before any decode
    assert set(runner.report()["static_requests"]) == {"1x32", "1x64", "2x32", "2x64"}
    assert runner.static_widths_at_start() == [32, 64]
    assert ov_args(tiny_llama_dir, 1).openvino_static_kv_len == 256  # the unpatched first width
    with pytest.raises(ValueError, match="openvino_static_kv_len=-1"):
        ov_args(tiny_llama_dir, 1, openvino_static_kv_len=-1)
