"""One request check, used by every front door: the offline Engine, `/generate`, the OpenAI
endpoints, and the scheduler process before it queues a request.

Sampling fields follow `SamplingParams.from_dict` (type and range per field). This module adds
what needs the model: the vocabulary, the context length, and how many characters of text can
possibly fit in it (so a 25 MB prompt is refused before it is tokenized). Every failure is a
`FieldError` (a ValueError) whose message starts with the field's name; HTTP answers it with a
400.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from airserve.srt.constrained.spec import check_grammar, grammar_of
from airserve.srt.sampling.logprobs import LogprobParams
from airserve.srt.sampling.sampling_params import (
    INT32_MAX,
    FieldError,
    SamplingParams,
    expect_bool,
    expect_int,
    refuse_not_implemented,
    show,
)

MAX_SAMPLES = 64  # n: parallel samples per prompt; more is refused, not queued
MAX_JSON_DEPTH = 32  # the deepest real request (chat content parts) nests 4 levels
_SURROGATE = re.compile("[\ud800-\udfff]")

# /generate's top-level SGLang fields that airserve does not implement -> no-op values.
NATIVE_NOT_IMPLEMENTED: dict[str, tuple] = {
    "return_hidden_states": (False,), "return_entropy": (False,),
    "input_embeds": ([],), "image_data": ([], ""), "video_data": ([], ""),
    "audio_data": ([], ""), "lora_path": ([], ""), "session_params": ({},),
    "custom_logit_processor": ("",),
    # Output-changing SGLang fields beyond the above (logprobs of chosen ids, bytes, LoRA by
    # id, MoE routing, forced reasoning).
    "token_ids_logprob": ([],), "return_bytes": (False,), "lora_id": ("",),
    "return_routed_experts": (False,), "require_reasoning": (False,),
}
# OpenAI (and SGLang's OpenAI extensions) fields that airserve does not implement.
OPENAI_NOT_IMPLEMENTED: dict[str, tuple] = {
    "suffix": ("",), "best_of": (1,),
    "functions": ([],), "function_call": ("none", "auto"), "json_schema": (),
    "structural_tag": (), "stop_regex": (), "no_stop_trim": (False,),
    "spaces_between_special_tokens": (True,), "continue_final_message": (False,),
    "chat_template_kwargs": ({},), "lora_path": ("",), "session_params": ({},),
    "return_hidden_states": (False,), "audio": (), "modalities": (["text"],),
    # Output-changing fields of OpenAI's and vLLM's newer protocols, accepted by SGLang.
    "reasoning_effort": (), "verbosity": (), "web_search_options": (), "prompt_logprobs": (),
    "sampling_seed": (), "token_ids_logprob": ([],),
}


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against; built once per model."""

    vocab_size: int
    context_length: int
    # Text longer than this cannot fit the context whatever it says (None: no such bound).
    max_prompt_chars: int | None = None
    # The KV pool's real size in tokens, as the scheduler reported it (None: not checked).
    max_total_tokens: int | None = None

    @classmethod
    def for_model(cls, tokenizer, vocab_size: int, context_length: int,
                  max_total_tokens: int | None = None) -> RequestLimits:
        """`tokenizer`: an `airserve.srt.tokenizer.Tokenizer`."""
        chars = max_chars_per_token(tokenizer)
        return cls(vocab_size, context_length,
                   None if chars is None else chars * context_length, max_total_tokens)


def max_chars_per_token(tokenizer) -> int | None:
    """An upper bound on the characters of input text one token can stand for, or None.

    A BPE token covers a piece of the (normalized) text at most as long as its own string; a
    byte-level token's string has one character per byte, so it covers no more characters. The
    bound only holds when normalization cannot shrink the text, so any normalizer but the
    SentencePiece space marker ("Prepend"/"Replace" of one character) gives None.
    """
    try:
        spec = json.loads(tokenizer.tokenizer.to_str())
    except (AttributeError, ValueError):
        return None
    if (spec.get("model") or {}).get("type") != "BPE" or not _safe_normalizer(
            spec.get("normalizer")):
        return None
    vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    return max((len(t) for t in vocab), default=1) or 1


def _safe_normalizer(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_safe_normalizer(n) for n in spec.get("normalizers", []))
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = (spec.get("pattern") or {}).get("String")
        return isinstance(pattern, str) and len(pattern) <= len(spec.get("content", ""))
    return False


# Building blocks.
def check_text(value: object, field: str, limits: RequestLimits | None = None) -> str:
    """A prompt string: valid Unicode text, and not longer than could ever fit."""
    if not isinstance(value, str):
        raise FieldError(field, f"must be a string, got {show(value)}")
    if not value.isascii() and _SURROGATE.search(value):
        raise FieldError(field, "holds a lone UTF-16 surrogate; send valid Unicode text")
    bound = limits.max_prompt_chars if limits is not None else None
    if bound is not None and len(value) > bound:
        raise FieldError(field, f"has {len(value)} characters, more than can fit the context "
                                f"length of {limits.context_length} tokens (at most {bound} "
                                "characters); shorten the prompt")
    return value


def check_input_ids(ids: object, limits: RequestLimits, field: str = "input_ids") -> list[int]:
    """A list of token ids of the model's vocabulary (the only vocabulary check)."""
    vocab = limits.vocab_size
    if not isinstance(ids, (list, tuple)) or not all(type(t) is int and 0 <= t < vocab
                                                     for t in ids):
        raise FieldError(field, f"must be a list of integers in [0, {vocab}), got {show(ids)}")
    return list(ids)


def check_fits(prompt_tokens: int, max_new_tokens: int, limits: RequestLimits) -> None:
    """The prompt is not empty, and it plus `max_new_tokens` fits the context length and the
    KV pool (a request that can never fit would run, then fail)."""
    if prompt_tokens == 0:
        raise FieldError("prompt", "is empty: give text or at least one input id")
    context = limits.context_length
    if prompt_tokens + max_new_tokens > context:
        raise FieldError(
            "max_new_tokens", f"the prompt ({prompt_tokens} tokens) plus max_new_tokens "
            f"({max_new_tokens}) exceeds the context length of {context} tokens; shorten the "
            "prompt or ask for fewer tokens (--context-length sets the limit, up to the model's)")
    pool = limits.max_total_tokens
    if pool is not None and prompt_tokens + max_new_tokens > pool:
        raise FieldError(
            "max_new_tokens", f"the prompt ({prompt_tokens} tokens) plus max_new_tokens "
            f"({max_new_tokens}) can never fit the KV pool of {pool} tokens; raise "
            "--max-total-tokens (or --mem-fraction-static), or ask for fewer tokens")


def validate_request(input_ids: object, sampling_params: Mapping | SamplingParams | None,
                     limits: RequestLimits, parse_grammar: bool = True) -> SamplingParams:
    """The whole check of one tokenized request; returns its parameters. The scheduler process
    calls this before it queues a request (the front doors ran it already, grammar parse
    included: the scheduler passes `parse_grammar=False` and compiles it off its loop)."""
    ids = check_input_ids(input_ids, limits)
    params = sampling_params if isinstance(sampling_params, SamplingParams) else \
        SamplingParams.from_dict(sampling_params)
    check_input_ids(params.stop_token_ids, limits, "stop_token_ids")
    outside = [t for t in params.logit_bias if t >= limits.vocab_size]
    if outside:
        raise FieldError("logit_bias", f"token id {outside[0]} is not in the vocabulary "
                                       f"[0, {limits.vocab_size})")
    check_fits(len(ids), params.max_new_tokens, limits)
    spec = grammar_of(params)
    if parse_grammar and spec is not None:
        check_grammar(spec, "sampling_params." + spec.kind)
    return params


MAX_TOP_LOGPROBS = 100  # top logprobs per position; more would only bloat the answer


def prompt_sampling_params(raw: object, num_prompts: int,
                           name: str = "sampling_params") -> tuple[list[SamplingParams], int]:
    """A request's `sampling_params` (SGLang's): one dict for every prompt or a list of one per
    prompt. Returns one SamplingParams per prompt and `n`, the samples per prompt (the same for
    every prompt). FieldError names the bad field under `name`."""
    if raw is None or isinstance(raw, Mapping):
        samples, rest = _pop_n(raw, f"{name}.")
        return [SamplingParams.from_dict(rest, prefix=f"{name}.")] * num_prompts, samples
    if not isinstance(raw, (list, tuple)):
        raise FieldError(name, f"must be an object or a list of objects, got {show(raw)}")
    if len(raw) != num_prompts:
        raise FieldError(name, f"has {len(raw)} entries for {num_prompts} prompts")
    popped = [_pop_n(p, f"{name}.{i}.") for i, p in enumerate(raw)]
    if len({samples for samples, _ in popped}) > 1:
        raise FieldError(f"{name}.n", "must be the same for every prompt")
    return [SamplingParams.from_dict(p, prefix=f"{name}.{i}.")
            for i, (_, p) in enumerate(popped)], popped[0][0]


def _pop_n(raw: object, prefix: str) -> tuple[int, object]:
    """`n` (1 when absent or null) and the sampling parameters without it."""
    if not isinstance(raw, Mapping) or raw.get("n") is None:
        return 1, raw
    rest = {k: v for k, v in raw.items() if k != "n"}
    return expect_int(prefix + "n", raw["n"], 1, MAX_SAMPLES), rest


def parse_logprob(body: Mapping, prompt_len: int, max_new_tokens: int) -> LogprobParams | None:
    """/generate's logprob fields (SGLang's names), checked; None when none is asked."""
    want = body.get("return_logprob")
    if want is None or want is False:
        return None
    expect_bool("return_logprob", want)
    top = body.get("top_logprobs_num")
    start = body.get("logprob_start_len")
    params = LogprobParams(
        True, 0 if top is None else expect_int("top_logprobs_num", top, 0, MAX_TOP_LOGPROBS),
        -1 if start is None else expect_int("logprob_start_len", start, -1, INT32_MAX))
    check_logprob(params, prompt_len, max_new_tokens)
    return params


def check_logprob(params: LogprobParams | None, prompt_len: int, max_new_tokens: int,
                  tokens_field: str = "max_new_tokens") -> None:
    """The first listed prompt position must be inside the prompt; prompt logprobs need a
    forward pass, which a request for no new token does not run (`tokens_field` names the
    request's field for max_new_tokens)."""
    if params is None:
        return
    if params.logprob_start_len >= prompt_len:
        raise FieldError("logprob_start_len", f"must be < the prompt length ({prompt_len} "
                                              f"tokens), got {params.logprob_start_len}")
    if max_new_tokens == 0 and params.start(prompt_len) < prompt_len - 1:
        raise FieldError(tokens_field, "must be >= 1 for prompt logprobs (they come from the "
                                       "forward pass that produces the first token)")


def check_json_value(value: object, max_depth: int = MAX_JSON_DEPTH) -> None:
    """A parsed JSON body: nested at most `max_depth` levels, no lone surrogate in any string
    (key or value). Iterative: a hostile body cannot exhaust the stack here."""
    stack: list[tuple[object, int, tuple]] = [(value, 0, ())]
    while stack:
        node, depth, path = stack.pop()
        if depth >= max_depth:
            raise FieldError(_path(path) or "body",
                             f"nested more than {max_depth} levels deep; flatten the request")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, item in items:
            if isinstance(key, str):
                _check_string(key, path + (key,))
            kind = type(item)
            if kind is str:
                _check_string(item, path + (key,))
            elif kind is list or kind is dict:
                stack.append((item, depth + 1, path + (key,)))


def _check_string(s: str, path: tuple) -> None:
    if not s.isascii() and _SURROGATE.search(s):
        raise FieldError(_path(path), "holds a lone UTF-16 surrogate; send valid Unicode text")


def _path(path: tuple) -> str:
    return ".".join(str(p) for p in path)


# The front doors import the sampling-field pieces from here too: one place to look.
__all__ = ["FieldError", "MAX_JSON_DEPTH", "NATIVE_NOT_IMPLEMENTED", "OPENAI_NOT_IMPLEMENTED",
           "RequestLimits", "SamplingParams", "check_fits", "check_input_ids", "check_json_value",
           "check_logprob", "check_text", "max_chars_per_token", "parse_logprob",
           "refuse_not_implemented", "validate_request"]
