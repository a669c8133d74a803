"""Serving metrics from per-request records, and SGLang's result table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from airserve.benchmark.backends import RequestOutput
from airserve.benchmark.datasets import encode


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration: float  # seconds
    total_input_tokens: int
    total_output_tokens: int
    total_output_tokens_retokenized: int | None
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    std_e2e_latency_ms: float
    p90_e2e_latency_ms: float
    p99_e2e_latency_ms: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _stats_ms(values: Sequence[float], prefix: str, percentiles: Sequence[int]) -> dict:
    """mean/median/std/pXX of `values` (seconds) in ms; all 0.0 for an empty list."""
    arr = np.asarray(values if len(values) else [0.0], dtype=np.float64) * 1000.0
    stats = {
        f"mean_{prefix}_ms": float(arr.mean()),
        f"median_{prefix}_ms": float(np.median(arr)),
        f"std_{prefix}_ms": float(arr.std()),
    }
    for p in percentiles:
        stats[f"p{p}_{prefix}_ms"] = float(np.percentile(arr, p))
    return stats


def calculate_metrics(
    outputs: Sequence[RequestOutput], duration: float, tokenizer: Any = None
) -> BenchmarkMetrics:
    """SGLang's definitions: token counts and latencies over successful requests only;
    TPOT = (latency - TTFT) / (output_len - 1) for requests with more than one token;
    concurrency = sum of E2E latencies / wall time. With a tokenizer, the generated texts are
    also re-tokenized (without special tokens) as a cross-check of the server's counts."""
    ok = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_len for o in ok)
    retokenized = None
    if tokenizer is not None:
        retokenized = sum(
            len(encode(tokenizer, o.generated_text, add_special_tokens=False)) for o in ok
        )
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    itls = [x for o in ok for x in o.itl]
    e2e = [o.latency for o in ok]
    dur = max(duration, 1e-9)
    max_itl = float(np.max(itls)) * 1000.0 if itls else 0.0
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(outputs) - len(ok),
        duration=duration,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        total_output_tokens_retokenized=retokenized,
        request_throughput=len(ok) / dur,
        input_throughput=total_input / dur,
        output_throughput=total_output / dur,
        total_throughput=(total_input + total_output) / dur,
        concurrency=sum(e2e) / dur,
        **_stats_ms(e2e, "e2e_latency", (90, 99)),
        **_stats_ms([o.ttft for o in ok], "ttft", (99,)),
        **_stats_ms(tpots, "tpot", (99,)),
        **_stats_ms(itls, "itl", (95, 99)),
        max_itl_ms=max_itl,
    )


def _row(label: str, value: Any, as_is: bool = False) -> str:
    # Floats get 2 decimals; ints, strings and settings (`as_is`) print unchanged.
    if isinstance(value, float) and not as_is:
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value:<10}"


def _section(title: str, fill: str) -> str:
    return "{s:{c}^{n}}".format(s=title, n=50, c=fill)


def format_table(
    m: BenchmarkMetrics, backend: str, request_rate: float, max_concurrency: int | None
) -> str:
    """The result block exactly as SGLang's bench_serving prints it (same labels, widths)."""
    lines = [
        _section(" Serving Benchmark Result ", "="),
        _row("Backend:", backend),
        _row("Traffic request rate:", request_rate, as_is=True),
        _row("Max request concurrency:", max_concurrency if max_concurrency else "not set"),
        _row("Successful requests:", m.completed),
        _row("Benchmark duration (s):", m.duration),
        _row("Total input tokens:", m.total_input_tokens),
        _row("Total generated tokens:", m.total_output_tokens),
    ]
    if m.total_output_tokens_retokenized is not None:
        retokenized = m.total_output_tokens_retokenized
        lines.append(_row("Total generated tokens (retokenized):", retokenized))
    lines += [
        _row("Request throughput (req/s):", m.request_throughput),
        _row("Input token throughput (tok/s):", m.input_throughput),
        _row("Output token throughput (tok/s):", m.output_throughput),
        _row("Total token throughput (tok/s):", m.total_throughput),
        _row("Concurrency:", m.concurrency),
        _section("End-to-End Latency", "-"),
        _row("Mean E2E Latency (ms):", m.mean_e2e_latency_ms),
        _row("Median E2E Latency (ms):", m.median_e2e_latency_ms),
        _row("P90 E2E Latency (ms):", m.p90_e2e_latency_ms),
        _row("P99 E2E Latency (ms):", m.p99_e2e_latency_ms),
        _section("Time to First Token", "-"),
        _row("Mean TTFT (ms):", m.mean_ttft_ms),
        _row("Median TTFT (ms):", m.median_ttft_ms),
        _row("P99 TTFT (ms):", m.p99_ttft_ms),
        _section("Time per Output Token (excl. 1st token)", "-"),
        _row("Mean TPOT (ms):", m.mean_tpot_ms),
        _row("Median TPOT (ms):", m.median_tpot_ms),
        _row("P99 TPOT (ms):", m.p99_tpot_ms),
        _section("Inter-Token Latency", "-"),
        _row("Mean ITL (ms):", m.mean_itl_ms),
        _row("Median ITL (ms):", m.median_itl_ms),
        _row("P95 ITL (ms):", m.p95_itl_ms),
        _row("P99 ITL (ms):", m.p99_itl_ms),
        _row("Max ITL (ms):", m.max_itl_ms),
        "=" * 50,
    ]
    return "\n".join(lines)
