"""Offline dataset loaders and samplers of the benchmark clients."""

from __future__ import annotations

import json

import numpy as np
import pytest

from airserve.benchmark import datasets as ds


def test_truncated_sharegpt_keeps_complete_records(sharegpt_file):
    records = ds.load_sharegpt_records(sharegpt_file)
    assert [r["id"] for r in records] == ["a", "b", "c", "d", "e"]
    pairs = ds.sharegpt_pairs(records)
    # "b" has one turn; "c" uses the `conversation` key and keeps only its first two turns.
    assert pairs == [
        ("Tell me a story about a cat.", "Once upon a time there was a cat named Tom."),
        ("What is two plus two?", "Four."),
        ("Hi", "x"),
        (
            "Explain graphs, briefly, in plain words please.",
            "A graph is a set of nodes joined by edges.",
        ),
    ]


def test_complete_sharegpt_file(tmp_path):
    path = tmp_path / "full.json"
    path.write_text(json.dumps([{"conversations": [{"value": "p"}, {"value": "c"}]}] * 3))
    assert len(ds.load_sharegpt_records(str(path))) == 3


def test_gsm8k_loader(tmp_path):
    path = tmp_path / "g.jsonl"
    rows = [{"question": f"q{i}", "answer": f"a\n#### {i}"} for i in range(3)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert ds.load_gsm8k(str(path)) == rows


def test_packaged_gsm8k():
    rows = ds.load_gsm8k()
    assert len(rows) == 1319
    assert rows[0]["answer"].endswith("#### 18")


def test_packaged_sharegpt_parses_past_truncation():
    records = ds.load_sharegpt_records()
    assert 17_000 < len(records) < 18_000
    assert 16_000 < len(ds.sharegpt_pairs(records)) <= len(records)


def test_sharegpt_sampling_filters_and_counts(sharegpt_file, byte_tokenizer):
    pairs = ds.sharegpt_pairs(ds.load_sharegpt_records(sharegpt_file))
    rows = ds.sample_sharegpt_requests(pairs, 10, byte_tokenizer, np.random.default_rng(0))
    # ("Hi", "x") has a 1-token completion and is dropped.
    assert sorted(r.prompt for r in rows) == sorted(p for p, _ in pairs if p != "Hi")
    for r in rows:
        completion = dict(pairs)[r.prompt]
        assert r.prompt_len == len(r.prompt.encode())
        assert r.output_len == len(completion.encode())

    fixed = ds.sample_sharegpt_requests(
        pairs, 2, byte_tokenizer, np.random.default_rng(0), fixed_output_len=7
    )
    assert len(fixed) == 2 and all(r.output_len == 7 for r in fixed)
    short = ds.sample_sharegpt_requests(
        pairs, 10, byte_tokenizer, np.random.default_rng(0), context_len=40
    )
    assert all(r.prompt_len + r.output_len <= 40 for r in short)
    assert [r.prompt for r in short] == ["What is two plus two?"]
    with pytest.raises(ValueError, match="at least 4"):
        ds.sample_sharegpt_requests(pairs, 1, byte_tokenizer, np.random.default_rng(0), 3)


def test_sharegpt_sampling_is_seeded(sharegpt_file, byte_tokenizer):
    pairs = ds.sharegpt_pairs(ds.load_sharegpt_records(sharegpt_file))

    def order(seed):
        rng = np.random.default_rng(seed)
        return [r.prompt for r in ds.sample_sharegpt_requests(pairs, 3, byte_tokenizer, rng)]

    assert order(5) == order(5)


def test_random_prompts_come_from_real_text(byte_tokenizer):
    texts = ["", "abc", "hello world"]
    rows = ds.sample_random_requests(
        20, 8, 12, 0.5, byte_tokenizer, np.random.default_rng(1), texts=texts
    )
    assert len(rows) == 12  # more prompts than texts: the corpus is reused
    for r in rows:
        assert 10 <= r.prompt_len <= 20 and 4 <= r.output_len <= 8
        assert len(r.prompt) == r.prompt_len
        assert (
            r.prompt in ("abc" * 7)[: r.prompt_len]
            or r.prompt == ("hello world" * 2)[: r.prompt_len]
        )
    exact = ds.sample_random_requests(
        16, 4, 3, 1.0, byte_tokenizer, np.random.default_rng(1), texts=texts
    )
    assert [(r.prompt_len, r.output_len) for r in exact] == [(16, 4)] * 3
    with pytest.raises(ValueError, match="no non-empty text"):
        ds.sample_random_requests(4, 4, 1, 1.0, byte_tokenizer, np.random.default_rng(1), [""])


def test_random_ids_uses_the_vocabulary(char_tokenizer):
    rows = ds.sample_random_requests(9, 5, 4, 1.0, char_tokenizer, np.random.default_rng(2))
    assert ds.vocab_size(char_tokenizer) == 101
    for r in rows:
        assert (r.prompt_len, r.output_len) == (9, 5)
        assert isinstance(r.prompt, str) and r.prompt


def test_random_lengths_range():
    lens = ds.random_lengths(100, 0.0, 500, np.random.default_rng(0))
    assert lens.min() >= 1 and lens.max() <= 100
    assert set(ds.random_lengths(10, 1.0, 50, np.random.default_rng(0)).tolist()) == {10}


def test_random_text_corpus_from_gsm8k_jsonl(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"question": "How many?", "answer": "#### 1"}) + "\n")
    assert ds.load_text_corpus(str(path)) == ["How many?"]


def test_encode_accepts_tokenizers_encoding(char_tokenizer, tmp_path, char_tokenizer_path):
    assert ds.encode(char_tokenizer, "ab") == [11, 12]
    loaded = ds.load_tokenizer(char_tokenizer_path)
    assert ds.encode(loaded, "ab", add_special_tokens=False) == [11, 12]


def test_generated_shared_prefix_groups_share_their_system_prompt(byte_tokenizer):
    texts = ["The quick brown fox. ", "", "Jumps over the lazy dog! "]
    rows = ds.sample_generated_shared_prefix_requests(
        3, 4, 30, 6, 9, byte_tokenizer, np.random.default_rng(4), texts
    )
    assert len(rows) == 12 and all(r.output_len == 9 for r in rows)
    systems = {r.prompt.split("\n\n")[0] for r in rows}
    assert len(systems) == 3 and all(len(s) == 30 for s in systems)
    for system in systems:
        group = [r for r in rows if r.prompt.startswith(system + "\n\n")]
        assert len(group) == 4 and len({r.prompt for r in group}) == 4  # distinct questions
    assert all(r.prompt_len == 30 + 2 + 6 for r in rows)
    # Shuffled: the four prompts of the first group are not all in front.
    first = rows[0].prompt.split("\n\n")[0]
    assert [r.prompt.startswith(first) for r in rows[:4]] != [True] * 4
    with pytest.raises(ValueError, match="--gsp-question-len"):
        ds.sample_generated_shared_prefix_requests(
            1, 1, 4, 0, 1, byte_tokenizer, np.random.default_rng(0), texts
        )
