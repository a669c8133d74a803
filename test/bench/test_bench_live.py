"""bench_serving and few_shot_gsm8k against a tiny deterministic HTTP server.

The server below is test scaffolding, not airserve's: it streams a fixed text one character
(= one token of the test's character tokenizer) at a time, two tokens per chunk, so every count
the clients report can be checked exactly. It records what it received.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading

import pytest
from aiohttp import web

from airserve import bench_serving
from airserve.test import few_shot_gsm8k

TOKENS_PER_CHUNK = 2


def _sse(data) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


def _text(n: int) -> str:
    return "".join("abcdefghij"[i % 10] for i in range(n))


def _gsm8k_answer(prompt: str) -> str:
    """Reads "say N" from the last question; answers N with thousands separators."""
    match = re.findall(r"say (\w+)", prompt.rsplit("Question:", 1)[-1])
    if not match or not match[-1].isdigit():
        return " I do not know."
    return f" We say {int(match[-1]):,}.\n#### {int(match[-1]):,}"


class FakeServer:
    def __init__(self, tokenizer_path: str):
        self.tokenizer_path = tokenizer_path
        self.reset()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    def reset(self) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.fail_every = 0  # every n-th /generate answers 500
        self.hang_s = 0.0  # /generate stalls this long before answering

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/v1/completions", self._openai)
        app.router.add_post("/v1/chat/completions", self._openai)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _stop(self) -> None:
        await self.runner.cleanup()
        # Handlers still sleeping (the stalled-server test) end here, not at interpreter exit.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def _model_info(self, request):
        return web.json_response(
            {"model_path": "fake-model", "tokenizer_path": self.tokenizer_path}
        )

    async def _generate(self, request):
        body = await request.json()
        self.requests.append(("/generate", body))
        if self.hang_s:
            await asyncio.sleep(self.hang_s)
        if self.fail_every and len(self.requests) % self.fail_every == 0:
            return web.json_response({"error": "injected"}, status=500)
        params = body["sampling_params"]
        if not body.get("stream"):
            text = _gsm8k_answer(body["text"])
            meta = {"completion_tokens": len(text), "prompt_tokens": len(body["text"])}
            return web.json_response({"text": text, "meta_info": meta})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = params["max_new_tokens"]
        for done in range(TOKENS_PER_CHUNK, n + TOKENS_PER_CHUNK, TOKENS_PER_CHUNK):
            done = min(done, n)
            meta = {"completion_tokens": done, "prompt_tokens": len(body["text"])}
            await resp.write(_sse({"text": _text(done), "meta_info": meta}))
            await asyncio.sleep(0.002)
        await resp.write(_sse(b"[DONE]"))
        await resp.write_eof()
        return resp

    async def _openai(self, request):
        body = await request.json()
        self.requests.append((request.path, body))
        chat = request.path.endswith("chat/completions")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for i in range(n):
            piece = _text(i + 1)[-1]
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"text": piece}
            await resp.write(_sse({"choices": [choice]}))
        usage = {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}
        empty = {"index": 0, "delta": {}} if chat else {"text": ""}
        await resp.write(_sse({"choices": [empty], "usage": usage}))
        await resp.write(_sse(b"[DONE]"))
        await resp.write_eof()
        return resp


@pytest.fixture(scope="module")
def server(char_tokenizer_path):
    srv = FakeServer(char_tokenizer_path)
    yield srv
    srv.stop()


@pytest.fixture
def fresh(server):
    server.reset()
    return server


def _read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_native_random_counts(fresh, tmp_path, sharegpt_file):
    out = tmp_path / "out.jsonl"
    cmd = [
        sys.executable, "-m", "airserve.bench_serving", "--backend", "airserve",
        "--port", str(fresh.port), "--dataset-name", "random", "--dataset-path", sharegpt_file,
        "--num-prompts", "8", "--random-input-len", "30", "--random-output-len", "9",
        "--random-range-ratio", "0.5", "--max-concurrency", "3", "--disable-tqdm",
        "--output-file", str(out), "--output-details",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "=" * 12 + " Serving Benchmark Result " + "=" * 12 in proc.stdout
    assert f"{'Successful requests:':<40} 8         " in proc.stdout

    (result,) = _read_jsonl(out)
    warm, *runs = [body for _, body in fresh.requests]
    assert len(runs) == 8 and warm["sampling_params"]["max_new_tokens"] <= 9
    for body in runs:
        assert body["stream"] is True
        assert body["sampling_params"]["temperature"] == 0
        assert body["sampling_params"]["ignore_eos"] is True
    sent_out = [b["sampling_params"]["max_new_tokens"] for b in runs]
    assert (result["completed"], result["failed"]) == (8, 0)
    assert result["model"] == "fake-model" and result["request_rate"] == "inf"
    assert result["total_output_tokens"] == sum(sent_out)
    assert result["total_output_tokens_retokenized"] == sum(sent_out)
    # One token per character: the server sees prompts of exactly the requested lengths.
    assert result["total_input_tokens"] == sum(len(b["text"]) for b in runs)
    assert all(15 <= n <= 30 for n in result["input_lens"])
    assert sorted(result["output_lens"]) == sorted(sent_out)
    # Chunks carry 2 tokens; each gap is spread over its tokens (one ITL per token but the
    # first chunk's).
    for n_out, itls in zip(result["output_lens"], result["itls"], strict=True):
        assert len(itls) == n_out - min(n_out, TOKENS_PER_CHUNK)
    assert result["mean_ttft_ms"] > 0 and result["mean_e2e_latency_ms"] > 0


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_openai_backends_sharegpt(fresh, tmp_path, sharegpt_file, char_tokenizer, backend):
    out = tmp_path / "out.jsonl"
    argv = [
        "--backend", backend, "--base-url", f"http://127.0.0.1:{fresh.port}",
        "--dataset-name", "sharegpt", "--dataset-path", sharegpt_file, "--num-prompts", "3",
        "--sharegpt-output-len", "6", "--warmup-requests", "0", "--request-rate", "50",
        "--disable-tqdm", "--output-file", str(out),
    ]  # fmt: skip
    assert bench_serving.main(argv, tokenizer=char_tokenizer) == 0
    (result,) = _read_jsonl(out)
    path = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    assert [p for p, _ in fresh.requests] == [path] * 3
    assert all(b["model"] == "fake-model" and b["max_tokens"] == 6 for _, b in fresh.requests)
    assert result["completed"] == 3 and result["total_output_tokens"] == 18
    assert result["total_output_tokens_retokenized"] == 18
    prompts = [b.get("prompt") or b["messages"][0]["content"] for _, b in fresh.requests]
    assert result["total_input_tokens"] == sum(len(p) for p in prompts)
    assert result["mean_itl_ms"] > 0


def test_failed_requests_are_counted(fresh, tmp_path, sharegpt_file, char_tokenizer, capsys):
    fresh.fail_every = 3
    out = tmp_path / "out.jsonl"
    argv = [
        "--port", str(fresh.port), "--dataset-name", "random-ids", "--num-prompts", "6",
        "--random-input-len", "5", "--random-output-len", "4", "--random-range-ratio", "1",
        "--warmup-requests", "0", "--disable-tqdm", "--output-file", str(out),
    ]  # fmt: skip
    assert bench_serving.main(argv, tokenizer=char_tokenizer) == 0
    (result,) = _read_jsonl(out)
    assert (result["completed"], result["failed"]) == (4, 2)
    assert result["total_output_tokens"] == 16 and result["total_input_tokens"] == 20
    assert "HTTP 500" in result["first_error"]
    assert "Failed requests: 2. First error: HTTP 500" in capsys.readouterr().out


def test_stalled_server_times_out(fresh, char_tokenizer, capsys):
    fresh.hang_s = 3.0
    argv = [
        "--port", str(fresh.port), "--dataset-name", "random-ids", "--num-prompts", "2",
        "--random-input-len", "4", "--random-output-len", "4", "--request-timeout", "0.3",
        "--disable-tqdm",
    ]  # fmt: skip
    assert bench_serving.main(argv, tokenizer=char_tokenizer) == 1
    assert "warmup failed: timed out" in capsys.readouterr().err


def test_few_shot_gsm8k(fresh, tmp_path, capsys):
    golds = [10, 11, 12, 1500, 14, 15, 16]
    says = ["10", "11", "12", "1500", "99", "none", "16"]  # row 4 wrong, row 5 invalid
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(
        json.dumps({"question": f"Row {i}: say {s}.", "answer": f"Work.\n#### {g:,}"}) + "\n"
        for i, (s, g) in enumerate(zip(says, golds, strict=True))
    ))  # fmt: skip
    result_file = tmp_path / "result.json"
    argv = [
        "--port", str(fresh.port), "--data-path", str(data), "--num-shots", "2",
        "--num-questions", "10", "--max-new-tokens", "64", "--parallel", "2",
        "--disable-tqdm", "--result-file", str(result_file),
    ]  # fmt: skip
    assert few_shot_gsm8k.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Accuracy: 0.600" and lines[1] == "Invalid: 0.200"
    assert re.fullmatch(r"Latency: \d+\.\d{3} s", lines[2])
    assert re.fullmatch(r"Output throughput: \d+\.\d{3} token/s", lines[3])

    saved = json.loads(result_file.read_text())
    assert [q["index"] for q in saved["questions"]] == [2, 3, 4, 5, 6]
    assert [q["pred"] for q in saved["questions"]] == [12, 1500, 99, None, 16]
    assert [q["label"] for q in saved["questions"]] == [12, 1500, 14, 15, 16]
    assert saved["num_output_tokens"] == sum(len(q["output"]) for q in saved["questions"])
    bodies = sorted((b for _, b in fresh.requests), key=lambda b: len(b["text"]))
    assert bodies[0]["sampling_params"] == {
        "max_new_tokens": 64, "temperature": 0.0,
        "stop": ["Question", "Assistant:", "<|separator|>"],
    }  # fmt: skip
    assert any(
        b["text"] == "Question: Row 0: say 10.\nAnswer: Work.\n#### 10\n\n"
        "Question: Row 1: say 11.\nAnswer: Work.\n#### 11\n\n"
        "Question: Row 2: say 12.\nAnswer:"
        for b in bodies
    )


def test_few_shot_gsm8k_reports_failures(fresh, tmp_path, capsys):
    fresh.fail_every = 2
    data = tmp_path / "gsm8k.jsonl"
    rows = [{"question": f"say {i}", "answer": f"#### {i}"} for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--port", str(fresh.port), "--data-path", str(data), "--num-shots", "0",
            "--num-questions", "4", "--parallel", "1", "--disable-tqdm"]  # fmt: skip
    assert few_shot_gsm8k.main(argv) == 1
    out = capsys.readouterr().out
    assert "Accuracy: 0.500" in out and "Failed requests: 2. First error: HTTP 500" in out
