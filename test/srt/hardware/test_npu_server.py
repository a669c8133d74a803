"""The server on an Ascend NPU, with the NPU graph runner and with TorchAirRunner
(`--enable-torch-compile`): same greedy tokens, same GSM8K accuracy, and decode throughput of
each recorded (printed and written as JSON; never asserted: benchmarks are not tests).

Skipped without an NPU. The probe runs in a child process: with torch-npu installed but CANN
not sourced, importing torch_npu breaks the importing process.

Tolerances: greedy decoding in bfloat16 on two compilation paths may flip an argmax after many
tokens, so the first GREEDY_PREFIX tokens must match for every prompt and the full outputs for
at least MATCH_FRACTION of them; GSM8K accuracies within GSM8K_DELTA.
Results land in $AIRSERVE_NPU_RESULTS (default: npu_results.json in the pytest tmp dir).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from airserve_testing.server_utils import free_port, wait_healthy

GREEDY_PREFIX = 16
MATCH_FRACTION = 0.75
GSM8K_DELTA = 0.03
GSM8K_QUESTIONS = 200
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
    "Once upon a time",
    "The largest planet in the solar system is",
    "Translate to French: good morning",
]
CONFIGS = {
    "npu_graph": ["--device", "npu"],
    "torchair": ["--device", "npu", "--enable-torch-compile"],
}
PROBE = "import torch, torch_npu; print(int(torch.npu.is_available()))"


@functools.lru_cache(maxsize=1)
def npu_available() -> bool:
    # A missing spec proves torch-npu is absent; a present one proves nothing (CANN may be
    # unsourced), hence the child process.
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                             timeout=300)
    except subprocess.TimeoutExpired:
        return False
    return out.returncode == 0 and out.stdout.strip().endswith("1")


pytestmark = [pytest.mark.npu, pytest.mark.slow,
              pytest.mark.skipif(not npu_available(), reason="needs an Ascend NPU with CANN")]


class Server:
    def __init__(self, flags: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "airserve.launch_server", "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 1800.0) -> None:  # torchair compiles every bucket
        def tail() -> str:
            with open(self.log.name) as f:
                return f.read()[-4000:]

        if not wait_healthy(self.proc, self.url, timeout, tail, poll_s=1.0):
            raise TimeoutError(tail())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def greedy_ids(url: str) -> list[list[int]]:
    import httpx

    params = {"temperature": 0, "max_new_tokens": 64}
    r = httpx.post(url + "/generate", json={"text": PROMPTS, "sampling_params": params},
                   timeout=600)
    r.raise_for_status()
    return [out["output_ids"] for out in r.json()]


def run_tool(module: str, args: list[str]) -> str:
    out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                         timeout=3600)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def gsm8k_accuracy(port: int) -> float:
    stdout = run_tool("airserve.test.few_shot_gsm8k",
                      ["--num-questions", str(GSM8K_QUESTIONS), "--port", str(port),
                       "--disable-tqdm"])
    return float(re.search(r"Accuracy: ([0-9.]+)", stdout).group(1))


def decode_throughput(port: int, out_file: str) -> dict:
    run_tool("airserve.bench_serving",
             ["--port", str(port), "--dataset-name", "random", "--num-prompts", "64",
              "--random-input-len", "128", "--random-output-len", "256",
              "--max-concurrency", "32", "--output-file", out_file, "--disable-tqdm"])
    with open(out_file) as f:
        last = json.loads(f.read().strip().splitlines()[-1])
    return {k: last.get(k) for k in ("output_throughput", "median_tpot_ms", "median_itl_ms")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Each configuration in turn (one NPU): greedy ids, GSM8K accuracy, throughput."""
    tmp = tmp_path_factory.mktemp("npu")
    out = {}
    for name, flags in CONFIGS.items():
        server = Server(flags)
        try:
            started = time.monotonic()
            server.wait_ready()
            out[name] = {"startup_s": round(time.monotonic() - started, 1),
                         "greedy_ids": greedy_ids(server.url),
                         "gsm8k_accuracy": gsm8k_accuracy(server.port),
                         "throughput": decode_throughput(server.port, str(tmp / f"{name}.jsonl"))}
        finally:
            server.stop()
    path = os.environ.get("AIRSERVE_NPU_RESULTS", str(tmp / "npu_results.json"))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "greedy_ids"}
                      for k, v in out.items()}, indent=1))
    return out


def test_greedy_outputs_match_with_and_without_torch_compile(results):
    eager, compiled = results["npu_graph"]["greedy_ids"], results["torchair"]["greedy_ids"]
    for prompt, a, b in zip(PROMPTS, eager, compiled):
        assert a[:GREEDY_PREFIX] == b[:GREEDY_PREFIX], prompt
    assert sum(a == b for a, b in zip(eager, compiled)) >= MATCH_FRACTION * len(PROMPTS)


def test_gsm8k_accuracy_matches(results):
    a = results["npu_graph"]["gsm8k_accuracy"]
    b = results["torchair"]["gsm8k_accuracy"]
    assert abs(a - b) <= GSM8K_DELTA, (a, b)


def test_decode_throughput_is_recorded(results):
    for name in CONFIGS:
        assert results[name]["throughput"]["output_throughput"] > 0
