"""benchmark/runners/compare_runners.py: report logic on fixed records, and the script itself
against the real server on a tiny model (eager mode only: a compile mode costs minutes)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from airserve_testing.server_utils import free_port

RUNNERS_DIR = Path(__file__).resolve().parents[2] / "benchmark" / "runners"
sys.path.insert(0, str(RUNNERS_DIR))

import compare_runners  # noqa: E402
import comparison_report  # noqa: E402

GSM8K_ROWS = [{"question": f"What is {a} plus {a}?", "answer": f"{a} + {a} = {2 * a}\n#### {2 * a}"}
              for a in range(1, 6)]  # fmt: skip


def _record(mode: str, outputs: dict[str, str], preds: dict[str, int | None]) -> dict:
    bench = [{"max_concurrency": c, "completed": 4, "output_throughput": 10.0 * c,
              "median_itl_ms": 5.0 + c, "p99_itl_ms": 9.0, "median_ttft_ms": 20.0}
             for c in (1, 4)]  # fmt: skip
    gsm8k = {"accuracy": 0.5, "invalid": 0.0, "output_throughput": 12.0, "outputs": outputs,
             "preds": preds}
    return {"mode": mode, "status": "ok", "error": None, "runner": "R", "startup_s": 3.0,
            "capture_s": 1.5, "eager_fallbacks": {"decode_bs_over_max": 2}, "bench": bench,
            "gsm8k": gsm8k}  # fmt: skip


def test_compare_outputs_lists_differing_questions():
    a = _record("eager", {"5": "x #### 1", "6": "y #### 2", "7": "z"}, {"5": 1, "6": 2, "7": None})
    b = _record("compile", {"5": "x #### 1", "6": "y2 #### 2", "7": "w #### 3"},
                {"5": 1, "6": 2, "7": 3})  # fmt: skip
    c = _record("openvino", dict(a["gsm8k"]["outputs"]), dict(a["gsm8k"]["preds"]))
    failed = {"mode": "x", "status": "failed", "error": "boom", "bench": [], "gsm8k": None}
    check = comparison_report.compare_outputs([a, failed, b, c])
    assert check["identical"] is False and check["reference"] == "eager"
    assert check["compared"] == ["eager", "compile", "openvino"]
    assert check["differing_text"] == {"compile": [6, 7], "openvino": []}
    assert check["differing_answer"] == {"compile": [7], "openvino": []}
    lines = comparison_report.check_lines(check)
    assert "**no**" in lines[0] and "row indices [6, 7]" in lines[1]

    same = comparison_report.compare_outputs([a, c])
    assert same["identical"] is True and "yes (3 questions" in comparison_report.check_lines(
        same)[0]
    assert comparison_report.compare_outputs([a])["identical"] is None


def test_table_rows_per_mode_columns_and_failures():
    ok = _record("eager", {}, {})
    failed = {"mode": "openvino", "status": "failed", "error": "no openvino\nmore", "bench": [],
              "gsm8k": None}
    rows = comparison_report.table_rows([ok, failed])
    ncols = rows[0].count("|") - 1
    assert ncols == 13 and all(row.count("|") - 1 == ncols for row in rows)
    cells = [c.strip() for c in rows[2].strip("|").split("|")]
    assert cells == ["eager", "R", "1", "10.0", "6.00", "9.00", "20.0", "0.500", "0.000",
                     "12.0", "3.0", "1.5", "2"]  # fmt: skip
    assert rows[3].startswith("|  |  | 4 | 40.0 | 9.00 ") and rows[3].endswith("|  |  |  |")
    assert rows[4].startswith("| openvino | **failed**: no openvino |")


def test_plan_modes_marks_unavailable(monkeypatch):
    monkeypatch.setattr(compare_runners, "unavailable_reason",
                        lambda m: "no ov" if m == "openvino" else None)  # fmt: skip
    parser = compare_runners.build_parser()
    default = compare_runners.plan_modes(parser.parse_args([]))
    assert [(r["mode"], r["status"]) for r in default] == [
        ("eager", "pending"), ("compile", "pending"), ("openvino", "skipped")]
    asked = compare_runners.plan_modes(parser.parse_args(["--modes", "eager,openvino"]))
    assert [(r["mode"], r["status"], r["error"]) for r in asked] == [
        ("eager", "pending", None), ("openvino", "failed", "no ov")]


def test_server_flags():
    args = compare_runners.build_parser().parse_args(
        ["--concurrency", "1,8", "--num-threads", "2", "--server-args", "--max-running-requests 8"])
    assert compare_runners.server_flags("eager", args) == [
        "--device", "cpu", "--num-threads", "2", "--max-running-requests", "8"]
    assert compare_runners.server_flags("openvino", args)[-4:] == [
        "--torch-compile-max-bs", "8", "--max-running-requests", "8"]


@pytest.fixture
def gsm8k_file(tmp_path) -> str:
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS), encoding="utf-8")
    return str(path)


def _argv(model_dir: str, gsm8k_file: str, out_dir, *extra: str) -> list[str]:
    return [
        "--modes", "eager", "--model-path", model_dir, "--num-threads", "1",
        "--port", str(free_port()), "--concurrency", "1,2", "--num-prompts", "3",
        "--input-len", "16", "--output-len", "6", "--dataset-path", gsm8k_file,
        "--gsm8k-data-path", gsm8k_file, "--gsm8k-shots", "1", "--gsm8k-questions", "3",
        "--gsm8k-max-new-tokens", "8", "--gsm8k-parallel", "2", "--output-dir", str(out_dir),
        *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_eager_end_to_end(tiny_llama_dir, gsm8k_file, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "cmp"
    assert compare_runners.main(_argv(tiny_llama_dir, gsm8k_file, out)) == 0
    results = json.loads((out / "results.json").read_text())
    (rec,) = results["modes"]
    assert rec["status"] == "ok" and rec["runner"] == "eager" and rec["exit_code"] == 0
    assert [b["max_concurrency"] for b in rec["bench"]] == [1, 2]
    assert all((b["completed"], b["failed"], b["total_output_tokens"]) == (3, 0, 18)
               for b in rec["bench"])  # fmt: skip
    assert sorted(rec["gsm8k"]["outputs"]) == ["1", "2", "3"]
    assert results["gsm8k_check"]["identical"] is None  # one mode: nothing to compare
    md = (out / "results.md").read_text()
    assert "| eager | eager | 1 |" in md and "| 2 |" in md
    for name in ("output_throughput.png", "median_itl.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "airserve is ready" in (out / "server_eager.log").read_text()


@pytest.mark.slow
def test_failed_start_is_reported(tiny_llama_dir, gsm8k_file, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "cmp"
    argv = _argv(tiny_llama_dir, gsm8k_file, out, "--server-args=--no-such-flag")
    assert compare_runners.main(argv) == 1
    (rec,) = json.loads((out / "results.json").read_text())["modes"]
    assert rec["status"] == "failed" and "--no-such-flag" in rec["error"]
    assert "| eager | **failed**: the server exited with code 2" in (out / "results.md").read_text()


@pytest.mark.slow
def test_ctrl_c_stops_the_server(tiny_llama_dir, gsm8k_file, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "cmp"
    # Long enough that the interrupt lands during the load: the tiny model decodes ~2000
    # tokens/s on a fast CPU, so 8 x 400 tokens once finished before the signal arrived.
    argv = _argv(tiny_llama_dir, gsm8k_file, out, "--output-len", "400", "--num-prompts", "400")
    proc = subprocess.Popen([sys.executable, str(RUNNERS_DIR / "compare_runners.py"), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    servers = []
    try:
        log = out / "server_eager.log"
        # As generous as ServerProcess.wait_ready: a server start takes ~20 s on a busy 2-core
        # machine, and longer when it builds the C++ kernels first.
        deadline = time.monotonic() + 300
        while not (log.exists() and "airserve is ready" in log.read_text()):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            time.sleep(0.2)
        servers = psutil.Process(proc.pid).children(recursive=True)
        assert servers
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            # The server runs in its own session: SIGKILL of the script alone orphans it.
            orphans = servers or psutil.Process(proc.pid).children(recursive=True)
            os.kill(proc.pid, signal.SIGKILL)
            for p in orphans:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
    assert proc.returncode == 130, output
    _, alive = psutil.wait_procs(servers, timeout=10)
    assert not alive
    (rec,) = json.loads((out / "results.json").read_text())["modes"]
    assert rec["status"] == "interrupted" and rec["exit_code"] == 0
    assert "server stopped" in log.read_text()
