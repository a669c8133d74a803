"""The kernel benchmark scripts run end to end on tiny sizes: each checks its forms against
each other before timing them, so a form that drifts from the code it measures fails here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
