"""Toy tokenizers for the benchmark-client tests (no model, no download)."""

from __future__ import annotations

import string

import pytest


class ByteTokenizer:
    """One token per UTF-8 byte; vocabulary of 256."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def make_char_tokenizer():
    """A real `tokenizers.Tokenizer`: one token per printable ASCII character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(string.printable)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


@pytest.fixture
def byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="session")
def char_tokenizer_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    make_char_tokenizer().save(str(path))
    return str(path)


@pytest.fixture(scope="session")
def char_tokenizer():
    return make_char_tokenizer()


SHAREGPT_RECORDS = [
    {
        "id": "a",
        "conversations": [
            {"from": "human", "value": "Tell me a story about a cat."},
            {"from": "gpt", "value": "Once upon a time there was a cat named Tom."},
        ],
    },
    {"id": "b", "conversations": [{"from": "human", "value": "Only one turn here."}]},
    {
        "id": "c",
        "conversation": [
            {"from": "human", "value": "What is two plus two?"},
            {"from": "gpt", "value": "Four."},
            {"from": "human", "value": "Thanks"},
        ],
    },
    {
        "id": "d",
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "x"},
        ],
    },
    {
        "id": "e",
        "conversations": [
            {"from": "human", "value": "Explain graphs, briefly, in plain words please."},
            {"from": "gpt", "value": "A graph is a set of nodes joined by edges."},
        ],
    },
]


@pytest.fixture
def sharegpt_file(tmp_path) -> str:
    """ShareGPT-style json cut in the middle of a sixth record, like the packaged file."""
    import json

    full = json.dumps(SHAREGPT_RECORDS + [SHAREGPT_RECORDS[0]], indent=2)
    cut = full.rindex('"Once upon')  # inside the last record
    path = tmp_path / "sharegpt.json"
    path.write_text(full[:cut], encoding="utf-8")
    return str(path)
