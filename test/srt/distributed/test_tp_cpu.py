"""Tensor parallelism on CPU: two ranks over gloo on this machine.

A TP=2 ModelRunner (in a subprocess: a process joins one process group for life) gives the
TP=1 logits within the parity tolerance and the same greedy ids; a TP=2 server answers with
the same greedy ids as one rank; killing rank 1 makes the server exit with a message naming
it, not hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from airserve_testing.server_utils import ServerProcess
from airserve_testing.tiny_gguf import PACKED_TYPES, write_tiny_gguf

# Summation order differs (partial products summed over ranks): the parity tolerance of
# test_parity_transformers.py.
ATOL = 2e-4
PROMPTS = [[5, 9, 14, 3, 22], [7, 7, 30]]


@pytest.fixture(scope="module")
def tiny_packed_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tp") / "m.gguf")
    write_tiny_gguf(path, "llama", qtypes=PACKED_TYPES)
    return path


def _decode(model: str, tp: int, tmp_path, compile_: bool = False) -> dict:
    if tp == 1 and not compile_:  # no process group: in this process
        from airserve.srt.model_executor.model_runner import ModelRunner
        from airserve_testing.tp_decode import decode_logits, runner_args

        args = runner_args(model, 1, False).replace(num_threads=None)  # keep torch's threads
        return {"logits": decode_logits(ModelRunner(args))}
    out = str(tmp_path / f"tp{tp}{'c' if compile_ else ''}.pt")
    cmd = [sys.executable, "-m", "airserve_testing.tp_decode", model, str(tp), out]
    proc = subprocess.run(cmd + (["--compile"] if compile_ else []), capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep
                          .join([os.path.abspath("test"), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("model", ["gguf", "qwen2"])
def test_tp2_logits_and_greedy_ids_equal_tp1(model, tiny_packed_gguf, tiny_qwen2_dir,
                                            tmp_path) -> None:
    """GGUF blocks (packed decode kernels, tied lm_head), eager and a safetensors Qwen2 (q/k/v
    biases, untied lm_head): TP=2 equals TP=1."""
    path = tiny_packed_gguf if model == "gguf" else tiny_qwen2_dir
    one, two = _decode(path, 1, tmp_path), _decode(path, 2, tmp_path)
    torch.testing.assert_close(two["logits"], one["logits"], atol=ATOL, rtol=0)
    assert torch.equal(two["logits"].argmax(-1), one["logits"].argmax(-1))


@pytest.mark.slow
def test_tp2_cpu_graph_runner_equals_tp1(tiny_packed_gguf, tmp_path) -> None:
    """The CPU graph runner compiles the decode step with its functional collectives over
    gloo: every decode step replays a graph (no eager fallback) and gives TP=1's logits."""
    one, two = _decode(tiny_packed_gguf, 1, tmp_path), _decode(tiny_packed_gguf, 2, tmp_path,
                                                               compile_=True)
    assert two["graph_replays"] == 6 and two["fallbacks"] == {}
    torch.testing.assert_close(two["logits"], one["logits"], atol=ATOL, rtol=0)
    assert torch.equal(two["logits"].argmax(-1), one["logits"].argmax(-1))


def test_tp2_server_greedy_ids_and_rank_death(tiny_packed_gguf) -> None:
    """The server at TP=2 answers with TP=1's greedy ids; SIGKILL of rank 1 makes it exit
    with an error naming the rank."""
    from airserve.srt.entrypoints.engine import Engine

    # float32 on every CPU (see tp_decode.runner_args).
    engine = Engine(tiny_packed_gguf, max_total_tokens=512, max_running_requests=4,
                    dtype="float32")
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    want = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS,
                                                     sampling_params=params)]
    engine.shutdown()
    srv = ServerProcess(tiny_packed_gguf, "--tp-size", "2", "--max-total-tokens", "512",
                        "--num-threads", "1", "--dtype", "float32").wait_ready(timeout=240)
    try:
        with srv.client() as http:
            got = [http.post("/generate", json={"input_ids": ids, "sampling_params": params})
                   .json()["output_ids"] for ids in PROMPTS]
            info = http.get("/get_server_info").json()
        assert got == want
        assert info["tp_size"] == 2 and len(info["tp_rank_pids"]) == 1
        os.kill(info["tp_rank_pids"][0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while srv.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert srv.proc.poll() not in (None, 0), "the server did not exit after rank 1 died"
        log = srv.log()
        assert "tensor parallel rank process airserve-tp1" in log and "exited with code -9" in log
    finally:
        srv.stop()


def test_openvino_runner_refuses_tp(tiny_packed_gguf) -> None:
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.server_args import ServerArgs

    args = ServerArgs(model_path=tiny_packed_gguf, tp_size=2, enable_torch_compile=True,
                      torch_compile_backend="openvino")
    with pytest.raises(ValueError, match="OpenVINO graph runner"):
        ModelRunner(args)
