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
