"""One real server for the whole directory (tests that kill or stop a server start their own)."""

from __future__ import annotations

import pytest

from airserve_testing.server_utils import ServerProcess

# Enough KV for 32 requests at the tiny model's full context (512).
SERVER_ARGS = ("--enable-metrics", "--max-total-tokens", "16384", "--max-running-requests", "32",
               "--decode-chunked-prefill-size", "128")


@pytest.fixture(scope="session")
def server(tiny_llama_dir) -> ServerProcess:
    srv = ServerProcess(tiny_llama_dir, *SERVER_ARGS).wait_ready()
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()


@pytest.fixture
def http(server):
    with server.client() as client:
        yield client
