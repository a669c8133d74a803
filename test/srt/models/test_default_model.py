"""The real default model (SmolLM2-135M-Instruct GGUF) against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from airserve import Engine
from airserve.srt.model_loader.gguf_loader import load_gguf
from airserve.srt.model_loader.loader import default_model_path

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def engine():
    # Exact float32 arithmetic, so greedy ids can equal transformers': float32 decode
    # activations, and float32 prefill (under --dtype auto a CPU with avx512_bf16 or AMX
    # prefills in bfloat16).
    return Engine(max_total_tokens=8192, max_running_requests=8,
                  cpu_decode_activations="float32", dtype="float32")


def transformers_model():
    import transformers

    ckpt = load_gguf(default_model_path())
    cfg = {k: v for k, v in ckpt.config.items() if k not in ("model_type", "architectures")}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).float().eval()
    state = dict(ckpt.tensors())
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


def test_greedy_ids_equal_transformers_on_the_same_dequantized_weights(engine):
    tok = engine.tokenizer
    texts = [
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
        "Question: Tom has 12 apples and gives 5 to Anna. How many apples does he have left?\n"
        "Answer:",
        "def fibonacci(n):",
    ]
    prompts = [tok.encode(t) for t in texts]
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    ours = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    hf = transformers_model()
    with torch.no_grad():
        for p, out in zip(prompts, ours):
            ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=tok.eos_token_ids[0])
            assert out == ref[0, len(p):].tolist()


def test_default_model_config_and_chat(engine):
    cfg = engine.model_runner.model_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size, cfg.tie_word_embeddings) == (
        30, 576, 9, 3, 49152, True)
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24})
    assert "Paris" in out["text"]


def _runnable_auto_paths() -> list[str]:
    from airserve.srt.hardware import host_cpu
    from airserve.srt.layers.quant import matmul_paths

    flags = host_cpu()[1]
    paths = [p for p in matmul_paths.PATHS if p != "float32" and matmul_paths.auto_eligible(p)]
    return [pytest.param(p, marks=pytest.mark.skipif(
        (p == "bfloat16" and not matmul_paths.cpu_has_bf16(flags))
        or (p in matmul_paths.FBGEMM_PATHS and not matmul_paths.int8_available()),
        reason=f"this CPU cannot run {p}")) for p in paths]


@pytest.mark.parametrize("large", ["float", "auto"])
@pytest.mark.parametrize("path", _runnable_auto_paths())
def test_paths_auto_may_pick_answer_as_float32(engine, path, large):
    """What matmul_paths.FIDELITY's "answers" records: every path `auto` may pick answers the
    README's chat example as float32 does (bf16 in every layer did not: it answered
    "L'Étoile, la Cité, ...", which is why the bfloat16 path keeps down_proj in float32); and
    so does each beside --cpu-large-activations auto (int8_blocks in the gate/up and down
    projections of decoder layers 3..26 under float16_weights, for decode batches above the
    packed limit and every prefill row but the last: int8 in the last row too gave "L'Étoile,
    la Marseillaise, ...")."""
    from airserve.srt.layers.quant import matmul_paths

    flags = ({"dtype": "bfloat16"} if path == "bfloat16"
             else {"dtype": "float32", "quantization": path})
    other = Engine(max_total_tokens=2048, max_running_requests=2,
                   cpu_decode_activations="float32", cpu_large_activations=large, **flags)
    try:
        large_range = other.model_runner.kernels_report()["matmul_paths"][-1]
        assert large_range["path"] == path
        int8 = large == "auto" and path == "float16_weights"
        assert (large_range.get("int8_blocks_layers", 0) == 48) == int8, large_range
        prompt = other.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}])
        params = {"temperature": 0, "max_new_tokens": 24}
        ours = other.generate(prompt, params)["text"]
    finally:
        other.shutdown()
    assert ours == engine.generate(prompt, params)["text"], ours
    assert "Paris" in ours
    assert matmul_paths.FIDELITY[path]["passed"]
