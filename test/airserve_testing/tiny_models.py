"""Tiny random-weight Llama / Qwen2 / Qwen3 checkpoints with a real byte-level BPE tokenizer."""

from __future__ import annotations

import json
import os

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog. 12345 + 678 = 13023.",
    "Question: Natalia sold clips to 48 of her friends in April. Answer: 72",
    "airserve captures the decode step once per batch size and replays it.",
    "Héllo wörld, ünïcode 你好 世界 🙂 emoji and accents.",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def tiny_config(model_type: str, vocab_size: int) -> dict:
    cfg = dict(
        model_type=model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=vocab_size,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
        tie_word_embeddings=model_type == "llama", bos_token_id=None, eos_token_id=0,
        torch_dtype="float32",
    )
    cfg["architectures"] = {"llama": ["LlamaForCausalLM"], "qwen2": ["Qwen2ForCausalLM"],
                            "qwen3": ["Qwen3ForCausalLM"]}[model_type]
    if model_type == "llama":
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return cfg


# The default model's shape (SmolLM2-135M): random weights of this size time a decode step the
# way the real model would, without its weights (scripts/check_cuda.sh).
SMOLLM2_135M_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                          vocab_size=49152, max_position_embeddings=8192, rope_scaling=None)


def make_tiny_model_dir(path, model_type: str, seed: int = 0, **shape) -> str:
    """Save a random-weight transformers model of `model_type` and a tokenizer under `path`;
    `shape` overrides config fields (e.g. SMOLLM2_135M_SHAPE; its vocabulary holds ids the
    tokenizer never produces, which token-id prompts can still use)."""
    import transformers

    path = str(path)
    tok = build_tokenizer(300)
    vocab = tok.get_vocab_size()
    cfg = {**tiny_config(model_type, vocab), **shape}
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config}[model_type]
    model_cls = {"llama": transformers.LlamaForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM}[model_type]
    torch.manual_seed(seed)
    hf_cfg = config_cls(**{k: v for k, v in cfg.items() if k not in ("model_type",
                                                                     "architectures")})
    model = model_cls(hf_cfg).to(torch.float32)
    # Random init is small; widen the weights so logits differ meaningfully between tokens.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
                   "add_bos_token": False}, f)
    return path


def load_hf(path: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    return model.eval()
