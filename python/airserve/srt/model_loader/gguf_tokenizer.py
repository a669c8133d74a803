"""Build a `tokenizers.Tokenizer` from GGUF tokenizer metadata (byte-level BPE, "gpt2" model).

A GGUF carries the vocabulary, merges and token types but not the pre-tokenizer itself, only its
name (`tokenizer.ggml.pre`). The name decides how text is split before BPE, so it has to be mapped
back to the split the model was trained with; getting it wrong changes token ids silently (e.g.
SmolLM2 splits every digit on its own, the plain GPT-2 split keeps runs of digits together).
The splits below are the ones in llama.cpp's `llama-vocab.cpp` and in the models' own
`tokenizer.json` files.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

logger = logging.getLogger(__name__)

# llama.cpp token types (`llama_token_type`).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT: applied one after another, each isolating its matches.
_DEFAULT_SPLITS = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)

# pre name -> (builder of the pre-tokenizer, BPE ignore_merges, add BOS when the file is silent)
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")
_QWEN2_NAMES = ("qwen2", "deepseek-r1-qwen")
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
_GPT2_NAMES = ("gpt2", "gpt-2", "mpt", "olmo", "jais")
FALLBACK_PRE = "gpt2"


def _split_then_bytes(*patterns: str) -> pre.PreTokenizer:
    splits = [pre.Split(Regex(p), behavior="isolated", invert=False) for p in patterns]
    return pre.Sequence([*splits, pre.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_pre_tokenizer(pre_name: str | None) -> tuple[pre.PreTokenizer, bool, bool]:
    """`(pre_tokenizer, ignore_merges, default_add_bos)` for a `tokenizer.ggml.pre` value.

    A missing name means llama.cpp's "default". An unknown name logs a warning and falls back to
    the GPT-2 byte-level split.
    """
    name = pre_name or "default"
    if name in _LLAMA3_NAMES:
        return _split_then_bytes(_LLAMA3_SPLIT), True, True
    if name in _QWEN2_NAMES:
        return _split_then_bytes(_QWEN2_SPLIT), False, False
    if name in _DIGITS_THEN_GPT2:
        # Same as SmolLM2's tokenizer.json: Digits(individual) then ByteLevel's GPT-2 regex.
        seq = [pre.Digits(individual_digits=True), pre.ByteLevel(add_prefix_space=False)]
        return pre.Sequence(seq), False, False
    if name == "default":
        return _split_then_bytes(*_DEFAULT_SPLITS), False, False
    if name not in _GPT2_NAMES:
        logger.warning(
            "GGUF pre-tokenizer %r is not known to airserve; falling back to the %r byte-level "
            "split. Token ids may differ from the model's reference tokenizer.",
            name,
            FALLBACK_PRE,
        )
    return pre.ByteLevel(add_prefix_space=False), False, False


def _post_processor(
    tokens: list[str], bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool
) -> processors.PostProcessor | None:
    single, pair, special = "$A", "$A $B:1", []
    if add_bos and bos_id is not None:
        single, pair = f"{tokens[bos_id]} {single}", f"{tokens[bos_id]} $A {tokens[bos_id]}:1 $B:1"
        special.append((tokens[bos_id], bos_id))
    if add_eos and eos_id is not None:
        single, pair = f"{single} {tokens[eos_id]}", f"{pair} {tokens[eos_id]}:1"
        special.append((tokens[eos_id], eos_id))
    if not special:
        return None
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def build_tokenizer(metadata: dict[str, Any]) -> dict[str, Any]:
    """Tokenizer and its settings from GGUF metadata (keys as in the file, `tokenizer.ggml.*`).

    Returns `{"tokenizer", "bos_token_id", "eos_token_id", "add_bos_token", "chat_template",
    "special_tokens"}`. `tokenizer.encode(text)` already prepends BOS when `add_bos_token` is true;
    pass `add_special_tokens=False` to get the bare ids.
    """
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported; airserve builds byte-level BPE "
            "tokenizers (tokenizer.ggml.model == 'gpt2') only."
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    pre_name = metadata.get("tokenizer.ggml.pre")
    pre_tokenizer, ignore_merges, default_add_bos = build_pre_tokenizer(pre_name)

    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(
        vocab=vocab,
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=ignore_merges,
    )
    tokenizer = Tokenizer(bpe)
    if pre_name in _QWEN2_NAMES:
        tokenizer.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, <|endoftext|>) must be matched whole before pre-tokenization;
    # user-defined ones (e.g. <think>) too, but they are not special (decode keeps them).
    special = [t for t, k in zip(tokens, token_types) if k == TOKEN_TYPE_CONTROL]
    user = [t for t, k in zip(tokens, token_types) if k == TOKEN_TYPE_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    post = _post_processor(tokens, bos_id, eos_id, add_bos, add_eos)
    if post is not None:
        tokenizer.post_processor = post
    if len(vocab) != len(tokens):
        logger.warning(
            "GGUF vocabulary has %d tokens but only %d distinct strings; ids of the duplicates "
            "cannot be produced by encode.",
            len(tokens),
            len(vocab),
        )
    return {
        "tokenizer": tokenizer,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "add_bos_token": add_bos,
        "chat_template": metadata.get("tokenizer.chat_template"),
        "special_tokens": special,
    }
