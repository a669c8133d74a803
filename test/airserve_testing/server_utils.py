"""Start `python -m airserve.launch_server` in a subprocess on a free loopback port.

Shared by the end-to-end tests (test/srt/entrypoints, test/bench).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx

API_KEY = "test-key"
# One torch thread: the test machine is small and shared, and spinning OpenMP threads make a
# tiny model hundreds of times slower there.
FAST_ARGS = ("--num-threads", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log: Callable[[], str],
                 poll_s: float = 0.1) -> bool:
    """True once `url`/health answers 200, False after `timeout` s; raises with the server's
    log (`log()`) if the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log()}")
        try:
            if httpx.get(url + "/health", timeout=max(poll_s, 1.0)).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    return False


class ServerProcess:
    def __init__(self, model_path: str, *args: str, api_key: str | None = API_KEY) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        cmd = [sys.executable, "-m", "airserve.launch_server", "--model-path", model_path,
               "--port", str(self.port), *FAST_ARGS, *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = tempfile.NamedTemporaryFile("w+", prefix="airserve-", suffix=".log",
                                                delete=False)
        # Own session: a test can signal the server alone, and cleanup can reach stragglers.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ,
                                                                  "PYTHONUNBUFFERED": "1"})

    def log(self) -> str:
        with open(self._log.name) as f:
            return f.read()

    # A start takes ~20 s on a busy 2-core machine; the first one in a fresh checkout also builds
    # the C++ kernels (minutes there), and a DP server's replicas wait for that one build.
    def wait_ready(self, timeout: float = 300.0) -> ServerProcess:
        if not wait_healthy(self.proc, self.url, timeout, self.log):
            self.stop()
            raise TimeoutError(f"server not ready in {timeout}s:\n{self.log()}")
        return self

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60.0, **kwargs)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then wait; kill the whole session if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
