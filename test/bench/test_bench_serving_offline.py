"""bench_serving without a model: metrics on synthetic records, the table, a down server."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time

import pytest

from airserve.benchmark.backends import RequestOutput, ServerUnreachable, probe_server
from airserve.benchmark.metrics import calculate_metrics, format_table


def _outputs() -> list[RequestOutput]:
    return [
        RequestOutput(True, "hello", 10, 5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        RequestOutput(True, "x", 20, 1, ttft=0.2, latency=0.2),
        RequestOutput(False, "", 30, 100, error="HTTP 500"),
    ]


def test_metrics_on_synthetic_records(byte_tokenizer):
    m = calculate_metrics(_outputs(), duration=2.0, tokenizer=byte_tokenizer)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 6)
    assert m.total_output_tokens_retokenized == 6  # "hello" + "x" in bytes
    assert m.request_throughput == pytest.approx(1.0)
    assert m.input_throughput == pytest.approx(15.0)
    assert m.output_throughput == pytest.approx(3.0)
    assert m.total_throughput == pytest.approx(18.0)
    assert m.concurrency == pytest.approx(0.35)
    assert m.mean_e2e_latency_ms == pytest.approx(350.0)
    assert m.median_e2e_latency_ms == pytest.approx(350.0)
    assert m.p99_e2e_latency_ms == pytest.approx(497.0)
    assert m.mean_ttft_ms == pytest.approx(150.0)
    assert m.p99_ttft_ms == pytest.approx(199.0)
    # TPOT only from requests with more than one token: (0.5 - 0.1) / 4.
    assert m.mean_tpot_ms == pytest.approx(100.0)
    assert m.mean_itl_ms == pytest.approx(100.0)
    assert m.p95_itl_ms == pytest.approx(100.0)
    assert m.max_itl_ms == pytest.approx(100.0)


def test_metrics_when_everything_failed():
    m = calculate_metrics([RequestOutput(error="boom")], duration=1.0)
    assert (m.completed, m.failed, m.total_output_tokens) == (0, 1, 0)
    assert m.mean_ttft_ms == 0.0 and m.max_itl_ms == 0.0
    assert m.total_output_tokens_retokenized is None


def test_table_matches_sglang_layout():
    m = calculate_metrics(_outputs(), duration=2.0)
    lines = format_table(m, "airserve", float("inf"), None).splitlines()
    assert lines[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert len(lines[0]) == 50 and lines[-1] == "=" * 50
    assert lines[1] == f"{'Backend:':<40} {'airserve':<10}"
    assert lines[2] == f"{'Traffic request rate:':<40} inf       "
    assert lines[3] == f"{'Max request concurrency:':<40} not set   "
    assert f"{'Successful requests:':<40} 2         " in lines
    assert f"{'Benchmark duration (s):':<40} 2.00      " in lines
    assert f"{'Total generated tokens:':<40} 6         " in lines
    assert f"{'Request throughput (req/s):':<40} 1.00      " in lines
    assert f"{'Concurrency:':<40} 0.35      " in lines
    assert "-" * 16 + "End-to-End Latency" + "-" * 16 in lines
    assert "-" * 15 + "Time to First Token" + "-" * 16 in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "-" * 15 + "Inter-Token Latency" + "-" * 16 in lines
    labels = [line[:40].strip() for line in lines if line[:1] not in "=-"]
    assert labels[-5:] == [
        "Mean ITL (ms):",
        "Median ITL (ms):",
        "P95 ITL (ms):",
        "P99 ITL (ms):",
        "Max ITL (ms):",
    ]
    assert "Total generated tokens (retokenized):" not in labels  # no tokenizer given
    rate_line = format_table(m, "openai", 4.0, 8).splitlines()[2:4]
    assert rate_line == [
        f"{'Traffic request rate:':<40} 4.0       ",
        f"{'Max request concurrency:':<40} 8         ",
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("module", ["airserve.bench_serving", "airserve.test.few_shot_gsm8k"])
def test_cli_against_a_down_server(module):
    port = _free_port()
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", module, "--port", str(port), "--disable-tqdm"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - start < 20
    assert proc.returncode == 1
    assert f"no server answering at http://127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_probe_gives_up_on_a_silent_server():
    # Accepts connections but never answers: the probe must time out, not hang.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        listener.settimeout(5)
        accepted = []

        def accept_and_stay_silent():
            try:
                while len(accepted) < 2:
                    accepted.append(listener.accept())
            except OSError:
                pass

        threading.Thread(target=accept_and_stay_silent, daemon=True).start()
        start = time.monotonic()
        with pytest.raises(ServerUnreachable, match="no server answering"):
            asyncio.run(probe_server(f"http://127.0.0.1:{port}", timeout=0.3))
        assert time.monotonic() - start < 5
        for conn, _ in accepted:
            conn.close()
