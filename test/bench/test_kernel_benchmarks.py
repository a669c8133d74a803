"""The kernel benchmark scripts run end to end on tiny sizes: each checks its forms against
each other before timing them, so a form that drifts from the code it measures fails here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from airserve.srt.layers import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]


def test_bench_prefill_ops_runs_and_reports_every_form(tmp_path):
    out = tmp_path / "prefill_ops.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmark/kernels/bench_prefill_ops.py"), "--prompts", "2",
         "--len", "16", "--repeats", "1", "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    forms = json.loads(out.read_text())["forms"]
    expected = {"attn_gather", "attn_batched", "rope_layer", "rope_pass"}
    if cpu_kernels.available():
        expected.add("attn_cpp_scalar")
    assert expected <= set(forms), sorted(forms)
    assert all(f["median_ms"] > 0 for f in forms.values())
    assert "| attn_batched |" in proc.stdout


def test_bench_decode_attention_times_dtypes_and_pages_side_by_side(tmp_path):
    if not cpu_kernels.available():
        pytest.fail(f"the C++ kernels did not build: {cpu_kernels.unavailable_reason()}")
    out = tmp_path / "decode_attention.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmark/kernels/bench_decode_attention.py"), "--ops",
         "cpp", "--bs", "2", "--lens", "9", "--threads", "1", "--seconds", "0.05",
         "--kv-dtype", "float16", "int8", "--page-size", "1", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["kv_dtypes"] == ["float16", "int8"] and report["page_sizes"] == [1, 4]
    (row,) = report["rows"]
    assert set(row["us"]) == {f"cpp/{dt}/p{ps}" for dt in ("float16", "int8") for ps in (1, 4)}
    assert all(us > 0 for us in row["us"].values())
