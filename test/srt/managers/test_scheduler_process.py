"""The scheduler process behind a live server: the KV pool it reports, requests that can never
fit it refused up front, and extreme sampling values that once killed it."""

from __future__ import annotations

import pytest

from airserve_testing.server_utils import ServerProcess

POOL = 256  # tokens; the tiny model's context is 512, so the pool is the tighter limit


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    srv = ServerProcess(tiny_llama_dir, "--max-total-tokens", str(POOL), "--page-size", "4",
                        "--max-running-requests", "4").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def http(server):
    with server.client() as client:
        yield client


def test_server_info_reports_the_real_kv_pool(server, http):
    info = http.get("/get_server_info").json()
    assert info["max_total_tokens"] == POOL
    assert info["kv_pool"]["tokens"] == POOL and info["kv_pool"]["pages"] == POOL // 4
    assert info["kv_pool"]["sized_by"] == "--max-total-tokens"
    assert info["kv_pool"]["bytes"] > 0
    log = server.log()
    assert f"KV pool: {POOL} tokens in {POOL // 4} pages of 4" in log
    # Every start-up stage says what it loads before it starts, so no long silent gap.
    stages = ["loading the tokenizer", "loading the model from", "KV pool:",
              "preparing the decode graph runner", "model loaded in", "airserve is ready"]
    positions = [log.find(stage) for stage in stages]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), log


@pytest.mark.parametrize("path,body", [
    ("/generate", {"input_ids": [5] * 100, "sampling_params": {"max_new_tokens": 200}}),
    ("/v1/completions", {"prompt": [5] * 100, "max_tokens": 200}),
])
def test_request_that_can_never_fit_the_pool_is_a_400_naming_the_flag(http, path, body):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"KV pool of {POOL} tokens" in message and "--max-total-tokens" in message
    fits = dict(body)
    fits.update({"sampling_params": {"max_new_tokens": 4}} if "sampling_params" in body
                else {"max_tokens": 4})
    assert http.post(path, json=fits).status_code == 200


@pytest.mark.parametrize("params", [
    {"temperature": 1e-40}, {"temperature": 5e-324}, {"temperature": 1e-40, "top_p": 1e-300},
    {"temperature": 1e-40, "repetition_penalty": 1e-300},
])
def test_tiny_temperatures_answer_like_greedy_and_the_server_lives_on(http, params):
    ids = [3, 17, 29, 4, 8]
    greedy = http.post("/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": 8, "ignore_eos": True}})
    r = http.post("/generate", json={"input_ids": ids, "sampling_params": {
        **params, "max_new_tokens": 8, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    if "repetition_penalty" not in params:
        assert r.json()["output_ids"] == greedy.json()["output_ids"]
    assert len(r.json()["output_ids"]) == 8
    assert http.get("/health").status_code == 200
    info = http.get("/get_server_info").json()
    assert info["available_kv_tokens"] == POOL  # every page back
