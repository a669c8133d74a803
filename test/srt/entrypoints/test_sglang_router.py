"""airserve servers as workers of SGLang's router (`sglang-router`): two workers on loopback
behind `python -m sglang_router.launch_router`, a mixed load through it (native and OpenAI,
streamed and not), then one worker killed mid-load: the router routes around it, and only the
requests in flight on the dead worker fail, cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from airserve_testing.server_utils import API_KEY, ServerProcess, free_port

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install "
                                            "sglang-router, or the `test` extra)")

N_NEW = 8
LONG = 480  # tokens (the tiny model's context is 512): in flight when the worker dies
TIMEOUT = 90.0  # catches a hang, never reached by a healthy run
# The router's --api-key: what its clients send, and what it sends to the workers.
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class Router:
    def __init__(self, worker_urls: list[str], worker_api_key: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="router-", suffix=".log",
                                                delete=False)
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls",
               *worker_urls, "--host", "127.0.0.1", "--port", str(self.port),
               "--policy", "round_robin", "--prometheus-port", str(free_port()),
               "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               "--api-key", worker_api_key, "--log-level", "warn"]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log(self) -> str:
        with open(self._log.name) as f:
            return f.read()

    def healthy_workers(self) -> set[str]:
        try:
            workers = httpx.get(self.url + "/workers", headers=AUTH, timeout=5).json()[
                "workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return set()
        return {w["url"] for w in workers if w["is_healthy"]}

    def wait_for_workers(self, urls: list[str], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.healthy_workers() != set(urls):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            assert time.monotonic() < deadline, f"workers not registered:\n{self.log()}"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    # The workers want an API key, as any reachable from other machines should. One running
    # request each: the rest wait in the worker's queue, so the killed worker still holds
    # requests when the test sees them all dispatched, even on a fast or a busy machine.
    workers = [ServerProcess(tiny_llama_dir, "--max-total-tokens", "8192",
                             "--max-running-requests", "1") for _ in range(2)]
    router = None
    try:
        for worker in workers:
            worker.wait_ready()
        router = Router([w.url for w in workers], API_KEY)
        router.wait_for_workers([w.url for w in workers])
        yield router, workers
    finally:
        if router is not None:
            router.stop()
        for worker in workers:
            worker.stop()


# One request of each kind; `check` returns the generated text of a complete answer.
def native(client: httpx.Client, prompt: str, stream: bool, n: int = N_NEW) -> str:
    body = {"text": prompt, "stream": stream,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    if not stream:
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["completion_tokens"] == n == len(out["output_ids"]), out
        return out["text"]
    events = sse_events(client, "/generate", body)
    assert events[-1]["meta_info"]["completion_tokens"] == n, events[-1]
    return events[-1]["text"]


def openai(client: httpx.Client, prompt: str, stream: bool, chat: bool) -> str:
    body = {"model": "default", "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["completion_tokens"] == N_NEW, out
        choice = out["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    events = sse_events(client, path, body)
    assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
    deltas = [e["choices"][0]["delta"].get("content") if chat else e["choices"][0]["text"]
              for e in events]
    return "".join(d for d in deltas if d)


def sse_events(client: httpx.Client, path: str, body: dict) -> list[dict]:
    """The JSON events of a complete stream; fails on an error event or a missing [DONE]."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert not any("error" in e for e in events), events[-1]
    return events


KINDS = {
    "native": lambda c, p: native(c, p, stream=False),
    "native-stream": lambda c, p: native(c, p, stream=True),
    "completions": lambda c, p: openai(c, p, stream=False, chat=False),
    "completions-stream": lambda c, p: openai(c, p, stream=True, chat=False),
    "chat": lambda c, p: openai(c, p, stream=False, chat=True),
    "chat-stream": lambda c, p: openai(c, p, stream=True, chat=True),
}


def mixed_load(url: str, rounds: int) -> dict[tuple[str, str], set[str]]:
    """Every kind for two prompts, `rounds` times, concurrently; (kind, prompt) -> texts."""
    jobs = [(kind, prompt) for _ in range(rounds) for kind in KINDS
            for prompt in ("The sky is", "Once upon a time")]

    def run(job):
        with httpx.Client(base_url=url, headers=AUTH, timeout=TIMEOUT) as client:
            return job, KINDS[job[0]](client, job[1])

    texts: dict[tuple[str, str], set[str]] = {}
    with ThreadPoolExecutor(6) as pool:
        for job, text in pool.map(run, jobs):
            texts.setdefault(job, set()).add(text)
    return texts


def get(worker: ServerProcess, path: str):
    return httpx.get(worker.url + path, headers=worker.headers, timeout=10).json()


def finished(worker: ServerProcess) -> int:
    return get(worker, "/get_server_info")["scheduler"]["finished_requests"]


def test_mixed_load_through_the_router(cluster):
    router, workers = cluster
    before = [finished(w) for w in workers]
    texts = mixed_load(router.url, rounds=2)
    # Greedy: the same request gives the same text on either worker, streamed or not.
    assert all(len(seen) == 1 for seen in texts.values()), texts
    for prompt in ("The sky is", "Once upon a time"):
        assert texts[("native", prompt)] == texts[("native-stream", prompt)]
        assert texts[("completions", prompt)] == texts[("completions-stream", prompt)]
        assert texts[("chat", prompt)] == texts[("chat-stream", prompt)]
    served = [finished(w) - b for w, b in zip(workers, before)]
    assert min(served) > 0 and sum(served) == 2 * 2 * len(KINDS), served
    # The routes the router calls on its workers, answered as SGLang's are.
    info = get(workers[0], "/server_info")
    assert info["dp_size"] == 1 and info["served_model_name"] and info["model_path"]
    assert get(workers[0], "/model_info")["is_generation"]
    assert httpx.post(router.url + "/flush_cache", headers=AUTH, timeout=30).status_code == 200


def test_a_killed_worker_fails_only_its_requests_and_the_router_routes_around_it(cluster):
    router, (alive, victim) = cluster
    n = 8

    def long_request(i: int) -> str:
        """'ok' for a complete answer, 'failed (why)' for a clean failure; a hang raises."""
        stream = i % 2 == 0
        with httpx.Client(base_url=router.url, headers=AUTH, timeout=TIMEOUT) as client:
            try:
                native(client, f"request {i}", stream=stream, n=LONG)
                return "ok"
            except httpx.TimeoutException:
                raise  # a hang, not a clean failure
            except (AssertionError, httpx.TransportError, ValueError, IndexError,
                    KeyError) as e:  # an error status, an error event, or a cut stream
                return f"failed ({type(e).__name__}: {str(e)[:80]})"

    with ThreadPoolExecutor(n) as pool:
        results = [pool.submit(long_request, i) for i in range(n)]
        deadline = time.monotonic() + TIMEOUT
        # Every request dispatched (in flight on a worker, or already answered: on a fast CPU
        # the first can finish its 480 tokens before the last is sent), some on the victim.
        while True:
            loads = [get(w, "/get_load")[0]["num_reqs"] for w in (alive, victim)]
            answered = sum(r.done() for r in results)
            if sum(loads) + answered == n and loads[1] > 0:
                break
            assert time.monotonic() < deadline and answered < n, (loads, answered)
            time.sleep(0.02)
        on_victim = loads[1]
        victim.proc.kill()  # SIGKILL: its scheduler follows when it sees its parent gone
        outcomes = [r.result(timeout=TIMEOUT) for r in results]
    print(f"\n{on_victim} of {n} requests in flight on the killed worker; outcomes {outcomes}")
    assert 0 < on_victim < n
    failed = [o for o in outcomes if o.startswith("failed")]
    assert len(failed) <= on_victim, outcomes
    assert outcomes.count("ok") >= n - on_victim, outcomes
    # After the death, everything goes to the live worker and is answered.
    texts = mixed_load(router.url, rounds=1)
    assert all(len(seen) == 1 for seen in texts.values()), texts
    assert victim.url not in router.healthy_workers()
