"""Data parallelism (--dp-size 2) on the tiny model: dispatch by queued tokens, every request
answered once with the outputs of one replica, aborts reaching the owning replica, calls
reaching every replica, and a dead replica ending the server with a clear error."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from airserve import Engine
from airserve.launch_server import parse_args
from airserve.srt.managers.data_parallel import OpenReq, Replica, check_threads, pick_replica
from airserve.srt.server_args import ServerArgs
from airserve_testing.server_utils import ServerProcess

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 480, "ignore_eos": True}
N_REQUESTS = 16


# The dispatcher's arithmetic, without processes.
def replica(rank: int, *loads: tuple[int, int, int]) -> Replica:
    r = Replica(rank, ServerArgs(dp_size=2))
    for i, (prompt, max_new, produced) in enumerate(loads):
        r.open_reqs[f"{rank}-{i}"] = OpenReq(prompt, max_new, produced)
    return r


def test_queued_tokens_count_the_prompt_until_prefilled_then_the_outputs_left():
    assert OpenReq(100, 20).queued_tokens == 120
    assert OpenReq(100, 20, output_tokens=1).queued_tokens == 19
    assert OpenReq(100, 20, output_tokens=25).queued_tokens == 0


def test_pick_replica_takes_the_fewest_queued_tokens_and_rotates_on_ties():
    busy, idle = replica(0, (100, 20, 0)), replica(1, (10, 5, 0))
    assert pick_replica([busy, idle], start=0) is idle
    assert pick_replica([busy, idle], start=1) is idle
    a, b = replica(0), replica(1)
    assert [pick_replica([a, b], start=i).rank for i in range(4)] == [0, 1, 0, 1]
    # Equal tokens: the one with fewer open requests.
    few, many = replica(0, (10, 10, 0)), replica(1, (5, 5, 0), (5, 5, 0))
    assert pick_replica([few, many], start=1) is few


def test_threads_warning_names_both_flags():
    assert check_threads(1, 8, 2) is None
    assert check_threads(2, 1, 2) is None
    warning = check_threads(2, 2, 2)
    assert "--dp-size 2" in warning and "--num-threads 2" in warning and "at most 1" in warning
    assert "torch's default" in check_threads(2, None, 4)


def test_dp_size_flags(capsys):
    assert parse_args(["--dp-size", "2"]).dp_size == 2
    assert parse_args(["--data-parallel-size", "3"]).dp_size == 3
    assert parse_args([]).dp_size == 1
    with pytest.raises(SystemExit):
        parse_args(["--dp-size", "0"])
    assert "dp_size=0: must be a positive integer" in capsys.readouterr().err


def test_offline_engine_refuses_dp_size():
    with pytest.raises(ValueError, match="dp_size=2.*--dp-size"):
        Engine(dp_size=2)


# A live server with two replicas.
@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # float32 on every CPU, as the one-process reference below: under `auto` with avx512_bf16 or
    # AMX batches above --packed-decode-max-bs multiply in bfloat16, a replica's decode batches
    # are smaller than the reference's 16, and equal greedy ids would hold by luck.
    srv = ServerProcess(tiny_llama_dir, "--dp-size", "2", "--enable-metrics",
                        "--max-total-tokens", "4096", "--dtype", "float32").wait_ready()
    yield srv
    if srv.proc.poll() is None:  # the last test kills a replica, and with it the server
        assert srv.stop() == 0, srv.log()
    else:
        srv.stop()


@pytest.fixture
def http(server):
    with server.client() as client:
        yield client


def replicas(http) -> list[dict]:
    return http.get("/get_server_info").json()["replicas"]


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_every_request_answered_once_with_single_replica_outputs(server, http, tiny_llama_dir):
    before = replicas(http)
    prompts = [[(7 * i + j) % 200 + 1 for j in range(3 + i % 5)] for i in range(N_REQUESTS)]

    def one(i: int) -> dict:
        with server.client() as client:
            r = client.post("/generate", json={"input_ids": prompts[i], "rid": f"dp-{i}",
                                               "sampling_params": GREEDY})
            assert r.status_code == 200, r.text
            return r.json()

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(N_REQUESTS)))
    assert [o["meta_info"]["id"] for o in outs] == [f"dp-{i}" for i in range(N_REQUESTS)]
    # One replica in this process computes the reference.
    with Engine(model_path=tiny_llama_dir, max_total_tokens=4096, dtype="float32") as engine:
        expected = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [e["output_ids"] for e in expected]

    wait_for(lambda: sum(r["open_requests"] for r in replicas(http)) == 0)
    after = replicas(http)
    sent = [a["dispatched_requests"] - b["dispatched_requests"] for a, b in zip(after, before)]
    done = [a["finished_requests"] - b["finished_requests"] for a, b in zip(after, before)]
    assert sum(sent) == N_REQUESTS and min(sent) >= N_REQUESTS // 4, sent  # both got work
    assert done == sent  # each replica ran exactly what it was sent: no request twice
    assert all(r["queued_tokens"] == 0 and r["kv_used_tokens"] == 0 for r in after)
    loads = http.get("/get_load").json()
    assert [entry["dp_rank"] for entry in loads] == [0, 1]
    assert all(entry["num_tokens"] == 0 and entry["num_reqs"] == 0 for entry in loads)


def test_data_parallel_rank_pins_a_replica_and_is_checked(http):
    before = replicas(http)
    for path, body in [("/generate", {"text": "Hi", "sampling_params": GREEDY}),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 4})]:
        r = http.post(path, json={**body, "data_parallel_rank": 1})
        assert r.status_code == 200, r.text
        bad = http.post(path, json={**body, "data_parallel_rank": 2})
        assert bad.status_code == 400 and "data_parallel_rank" in bad.text, bad.text
    after = replicas(http)
    assert after[1]["dispatched_requests"] - before[1]["dispatched_requests"] == 2
    assert after[0]["dispatched_requests"] == before[0]["dispatched_requests"]


@pytest.mark.parametrize("rank", [0, 1])
def test_abort_reaches_the_replica_that_owns_the_request(server, http, rank):
    before = replicas(http)[rank]["aborted_requests"]
    body = {"text": "Hello", "sampling_params": LONG, "stream": True,
            "data_parallel_rank": rank}
    with server.client() as client, client.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        next(lines)  # decoding on `rank` now; leaving the block drops the connection
    # Without the abort the replica would decode 480 tokens; with it, it stops at once.
    wait_for(lambda: replicas(http)[rank]["aborted_requests"] == before + 1)
    wait_for(lambda: replicas(http)[rank]["num_running_reqs"] == 0, timeout=5)


def test_flush_cache_and_metrics_cover_every_replica(http):
    for rank in (0, 1):
        http.post("/generate", json={"text": "cache me", "data_parallel_rank": rank,
                                     "sampling_params": GREEDY})
    wait_for(lambda: all(r["prefix_cache"]["cached_tokens"] > 0 for r in replicas(http)))
    metrics = http.get("/metrics").text
    for rank in (0, 1):
        assert f'airserve:num_running_reqs{{dp_rank="{rank}"' in metrics, metrics
    r = http.post("/flush_cache")
    assert r.status_code == 200, r.text
    assert all(r["prefix_cache"]["cached_tokens"] == 0 for r in replicas(http))


def test_a_dead_replica_fails_its_requests_and_the_server_exits(server, http):
    """Kept last: it ends the module's server."""
    victim = replicas(http)[1]["pid"]
    body = {"text": "Hello", "sampling_params": LONG, "stream": True, "data_parallel_rank": 1}
    with server.client() as client, client.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    message = json.loads(rest[-2][len("data: "):])["error"]["message"]
    assert "data-parallel replica 1: the scheduler process died (killed by SIGKILL)" in message
    assert "restart the server" in message
    assert server.proc.wait(10) != 0, server.log()
    assert time.monotonic() - killed < 5
    assert "data-parallel replica 1" in server.log()
