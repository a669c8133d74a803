"""Client-side benchmark tools: offline datasets, streaming request clients and metrics.

Entry points: `python -m airserve.bench_serving` (throughput and latency) and
`python -m airserve.test.few_shot_gsm8k` (accuracy).
"""

from __future__ import annotations

from airserve.benchmark.datasets import (
    DatasetRow,
    load_gsm8k,
    load_sharegpt_records,
    load_text_corpus,
    sample_random_requests,
    sample_sharegpt_requests,
    sharegpt_pairs,
)

__all__ = [
    "DatasetRow",
    "load_gsm8k",
    "load_sharegpt_records",
    "load_text_corpus",
    "sample_random_requests",
    "sample_sharegpt_requests",
    "sharegpt_pairs",
]
