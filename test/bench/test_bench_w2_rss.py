"""bench_w2's peak RSS: every worker process tree is sampled from outside (children included),
so a row never comes back without the figure; and the ratios of bench_w1's rounds."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmark" / "throughput" / "bench_w2.py"


@pytest.fixture(scope="module")
def bench_w2():
    spec = importlib.util.spec_from_file_location("bench_w2_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_worker(tmp_path: Path, child_mib: int, exit_code: int = 0) -> Path:
    """A worker that starts a child holding `child_mib` MiB for a second, then writes the
    result file (argv[2]) with its own getrusage figure, as the real workers do."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(f"""
        import json, subprocess, sys
        hold = "b = bytearray({child_mib} * 2**20); import time; time.sleep(1.0)"
        subprocess.run([sys.executable, "-c", hold], check=True)
        json.dump({{"peak_rss_mb": 1.0, "wall_s": 1.0}}, open(sys.argv[2], "w"))
        sys.exit({exit_code})
    """))
    return script


def test_peak_rss_counts_the_worker_tree(bench_w2, tmp_path):
    worker = write_worker(tmp_path, child_mib=300)
    row = bench_w2.run_child([sys.executable, str(worker)], {"x": 1}, tmp_path, "w", 60)
    assert row["peak_rss_mb"] >= 300  # the child's bytearray, seen from outside
    assert row["peak_rss_self_mb"] == 1.0  # the worker's own figure kept beside it
    assert row["wall_s"] == 1.0


def test_failed_worker_raises_with_its_log(bench_w2, tmp_path):
    worker = write_worker(tmp_path, child_mib=1, exit_code=3)
    with pytest.raises(RuntimeError, match="exited with 3"):
        bench_w2.run_child([sys.executable, str(worker)], {}, tmp_path, "bad", 60)


def test_table_prints_a_dash_for_a_missing_figure(bench_w2, capsys):
    rows = [{"config": "airserve:eager", "output_tok_s": 10.0, "wall_s": 2.0,
             "ttft_lone_ms": 5.0, "peak_rss_mb": None, "same_ids": 1.0},
            {"config": "ov-genai:fp32", "output_tok_s": 20.0, "wall_s": 1.0,
             "ttft_lone_ms": 5.0, "peak_rss_mb": 1234.4, "same_ids": 1.0}]
    bench_w2.print_table(rows, "cpu")
    lines = capsys.readouterr().out.splitlines()
    assert "| 0.50x | 2.0 | 5 | - |" in lines[-2]
    assert "| 1234 |" in lines[-1]


def test_ratios_are_taken_within_each_round(bench_w2, capsys):
    """--rounds: a configuration's ratio is against OpenVINO GenAI's run of the same round, so a
    machine that slows between rounds does not show up as a change of ratio."""
    rows = [
        {"config": "ov-genai:fp32", "round": 0, "wall_s": 1, "output_tok_s": 800.0},
        {"config": "airserve:compile", "round": 0, "wall_s": 1, "output_tok_s": 400.0},
        {"config": "ov-genai:fp32", "round": 1, "wall_s": 1, "output_tok_s": 400.0},
        {"config": "airserve:compile", "round": 1, "wall_s": 1, "output_tok_s": 300.0},
        {"config": "airserve:compile", "round": 2, "error": "boom"},
        {"config": "ov-genai:fp32", "round": 2, "wall_s": 1, "output_tok_s": 500.0},
    ]
    assert bench_w2.round_ratios(rows)["airserve:compile"] == [0.5, 0.75]
    summary = bench_w2.print_summary(rows)
    assert summary["airserve:compile"]["median_ratio"] == 0.625
    assert summary["airserve:compile"]["median_output_tok_s"] == 350.0
    assert summary["ov-genai:fp32"]["ratios"] == [1.0, 1.0, 1.0]
    assert "| airserve:compile | 2 | 350.0 | 0.62x |" in capsys.readouterr().out


def test_bench_w1_ratios_are_taken_within_each_round():
    """bench_w1 --rounds: a configuration's ratio uses llama.cpp's run of its own round, and a
    round without a llama.cpp run gives no ratio (it ignored --rounds before)."""
    spec = importlib.util.spec_from_file_location("bench_w1_under_test",
                                                  BENCH.with_name("bench_w1.py"))
    bench_w1 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_w1)
    rows = [{"config": "llama-cpp", "round": 1, "decode_tok_s": 100.0},
            {"config": "airserve:compile", "round": 1, "decode_tok_s": 120.0},
            {"config": "llama-cpp", "round": 2, "decode_tok_s": 150.0},
            {"config": "airserve:compile", "round": 2, "decode_tok_s": 120.0},
            {"config": "airserve:compile", "round": 3, "decode_tok_s": 90.0},
            {"config": "served:compile", "round": 1, "error": "boom"}]
    assert bench_w1.llama_cpp_ratio(rows[1], rows) == 1.2
    assert bench_w1.llama_cpp_ratio(rows[3], rows) == 0.8
    assert bench_w1.llama_cpp_ratio(rows[4], rows) is None
    summary = bench_w1.summarize_rounds(rows)
    assert summary["airserve:compile"]["rounds"] == 3
    assert summary["airserve:compile"]["median_decode_tok_s"] == 120.0
    assert summary["airserve:compile"]["ratios"] == [1.2, 0.8]
    assert summary["airserve:compile"]["median_ratio"] == 1.0
    assert "served:compile" not in summary
