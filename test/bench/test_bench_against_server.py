"""bench_serving and few_shot_gsm8k against the real airserve server on a tiny random model.

test_bench_live.py checks the clients' arithmetic against a scripted fake server; this file
checks that they and the real server agree on the protocol: every request completes, and with
ignore_eos the server generates exactly the requested number of tokens.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from airserve import bench_serving
from airserve.test import few_shot_gsm8k
from airserve_testing.server_utils import ServerProcess

pytestmark = pytest.mark.slow

SERVER_ARGS = ("--max-total-tokens", "8192", "--max-running-requests", "8")
GSM8K_ROWS = [
    {"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
     "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b:,}"}
    for a, b in [(3, 4), (10, 5), (7, 8), (1200, 34), (6, 6), (9, 1)]
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # No API key: the benchmark clients, like SGLang's, send none.
    srv = ServerProcess(tiny_llama_dir, *SERVER_ARGS, api_key=None).wait_ready()
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()


@pytest.fixture(scope="module")
def gsm8k_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gsm8k") / "test.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS), encoding="utf-8")
    return str(path)


def _bench_argv(server: ServerProcess, backend: str, text_file: str, out) -> list[str]:
    return [
        "--backend", backend, "--base-url", server.url, "--dataset-name", "random",
        "--dataset-path", text_file, "--num-prompts", "5", "--random-input-len", "24",
        "--random-output-len", "10", "--random-range-ratio", "0.5", "--max-concurrency", "3",
        "--disable-tqdm", "--output-file", str(out), "--output-details",
    ]  # fmt: skip


def _check_counts(stdout: str, out, num_prompts: int) -> dict:
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    # The client prints the sum of the lengths it asked for before sending anything.
    requested = int(re.search(r"^#Output tokens: (\d+)$", stdout, re.M).group(1))
    assert (result["completed"], result["failed"]) == (num_prompts, 0), result["first_error"]
    assert result["total_output_tokens"] == requested
    assert all(n >= 5 for n in result["output_lens"])  # range ratio 0.5 of 10
    # Streamed, not one chunk per request. Some request may still arrive whole: the tiny
    # model's byte-level tokens are random bytes, and the server holds back text that ends in
    # an incomplete UTF-8 sequence (tokenizer.py), so a short answer can complete only at its
    # last token, whatever the batch composition made greedy decoding pick.
    assert any(len(itl) > 0 for itl in result["itls"]), result["itls"]
    assert result["mean_ttft_ms"] > 0 and result["output_throughput"] > 0
    return result


def test_bench_serving_native_cli(server, gsm8k_file, tmp_path):
    out = tmp_path / "native.jsonl"
    cmd = [sys.executable, "-m", "airserve.bench_serving",
           *_bench_argv(server, "airserve", gsm8k_file, out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " Serving Benchmark Result " in proc.stdout
    result = _check_counts(proc.stdout, out, 5)
    with server.client() as http:
        assert result["model"] == http.get("/v1/models").json()["data"][0]["id"]


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_bench_serving_openai(server, gsm8k_file, tmp_path, capsys, backend):
    out = tmp_path / f"{backend}.jsonl"
    assert bench_serving.main(_bench_argv(server, backend, gsm8k_file, out)) == 0
    _check_counts(capsys.readouterr().out, out, 5)


def test_few_shot_gsm8k(server, gsm8k_file, tmp_path, capsys):
    result_file = tmp_path / "gsm8k_result.json"
    argv = [
        "--port", str(server.port), "--data-path", gsm8k_file, "--num-shots", "2",
        "--num-questions", "4", "--max-new-tokens", "16", "--parallel", "4",
        "--disable-tqdm", "--result-file", str(result_file),
    ]  # fmt: skip
    assert few_shot_gsm8k.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"Accuracy: [01]\.\d{3}", lines[0])
    assert re.fullmatch(r"Invalid: [01]\.\d{3}", lines[1])
    assert re.fullmatch(r"Latency: \d+\.\d{3} s", lines[2])
    assert re.fullmatch(r"Output throughput: \d+\.\d{3} token/s", lines[3])

    saved = json.loads(result_file.read_text())
    questions = saved["questions"]
    assert saved["num_questions"] == 4 and saved["failed"] == 0
    assert [q["index"] for q in questions] == [2, 3, 4, 5]
    assert [q["label"] for q in questions] == [15, 1234, 12, 10]
    for q in questions:
        assert q["error"] == "" and isinstance(q["output"], str)
        assert 1 <= q["completion_tokens"] <= 16
        assert "Question" not in q["output"]  # the stop string is trimmed
        assert q["correct"] == (q["pred"] == q["label"])
    assert saved["num_output_tokens"] == sum(q["completion_tokens"] for q in questions)
    assert saved["accuracy"] == sum(q["correct"] for q in questions) / 4
    assert lines[0] == f"Accuracy: {saved['accuracy']:.3f}"
