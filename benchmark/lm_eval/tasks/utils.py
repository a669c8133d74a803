"""Local data for the lm-eval tasks in this folder: the GSM8K test rows that ship in the
benchmark data package (no hub access)."""

from __future__ import annotations


def load_gsm8k(**kwargs) -> dict:
    """{"test": Dataset} of every packaged GSM8K row (`--limit` takes the first few)."""
    import datasets

    from airserve.benchmark.datasets import load_gsm8k as rows

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows())})


def answer(doc: dict) -> str:
    """The final number after GSM8K's '####'."""
    return doc["answer"].split("####")[-1].strip().replace(",", "")
