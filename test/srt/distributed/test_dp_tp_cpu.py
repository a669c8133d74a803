"""Data parallel x tensor parallel on CPU: --dp-size 2 --tp-size 2 runs two replicas of two
gloo ranks each (four model processes) behind one server.

Greedy outputs equal one process's, both replicas take requests, each replica's group meets at
its own address, and a killed rank of one replica ends the server with an error naming the
replica and the rank. Also the pure placement rules: each replica's rendezvous port and its
ranks' devices."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from airserve import Engine
from airserve.launch_server import parse_args
from airserve.srt.distributed.parallel_state import select_device
from airserve.srt.managers.data_parallel import check_threads, replica_args
from airserve.srt.model_executor.tp_worker import device_index, resolve_init_addr
from airserve.srt.server_args import ServerArgs
from airserve_testing.server_utils import ServerProcess

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = [[(5 * i + j) % 150 + 1 for j in range(3 + i % 4)] for i in range(6)]


# Placement, without processes.
def placements(args: ServerArgs) -> list[list[int]]:
    """Per replica, the device of each of its ranks on this machine."""
    per_node = args.tp_size // args.nnodes
    first = args.node_rank * per_node
    return [[device_index(replica_args(args, r), k) for k in range(first, first + per_node)]
            for r in range(args.dp_size)]


def test_each_replica_gets_its_own_block_of_devices():
    assert placements(ServerArgs(dp_size=2, tp_size=2)) == [[0, 1], [2, 3]]
    assert placements(ServerArgs(dp_size=2, tp_size=2, base_gpu_id=1)) == [[1, 2], [3, 4]]
    assert placements(ServerArgs(dp_size=3)) == [[0], [1], [2]]
    assert placements(ServerArgs(tp_size=3, base_gpu_id=2)) == [[2, 3, 4]]
    # Across machines (one replica): each machine numbers its ranks' devices from the base.
    two_nodes = ServerArgs(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert placements(two_nodes) == [[0, 1]]


def test_a_device_the_machine_lacks_is_refused():
    # Real torch: on a machine without that many devices (here: none), a clear error.
    missing = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=f"cuda device {missing}.*--base-gpu-id"):
        select_device("cuda", missing)
    select_device("cpu", 5)  # cpu ranks share the host: nothing to pick


def test_each_replica_meets_at_its_own_port():
    given = ServerArgs(dp_size=3, tp_size=2, dist_init_addr="127.0.0.1:29500")
    addrs = [replica_args(given, r).dist_init_addr for r in range(3)]
    assert addrs == ["127.0.0.1:29500", "127.0.0.1:29501", "127.0.0.1:29502"]
    assert [replica_args(given, r).dp_rank for r in range(3)] == [0, 1, 2]
    # Without the flag each replica's rank 0 picks a free loopback port in its own process.
    free = replica_args(ServerArgs(dp_size=2, tp_size=2), 1)
    assert free.dist_init_addr is None
    assert resolve_init_addr(free).dist_init_addr.startswith("127.0.0.1:")


def test_threads_warning_counts_every_rank_of_every_replica():
    assert check_threads(2, 1, 4, tp_size=2) is None  # 4 processes x 1 thread on 4 CPUs
    warning = check_threads(2, 1, 2, tp_size=2)
    assert "--dp-size 2 x --tp-size 2 x --num-threads 1 = 4 torch threads on 2 CPUs" in warning
    assert "use fewer replicas or ranks" in warning
    assert "at most 2" in check_threads(2, 4, 8, tp_size=2)


def test_flags_base_gpu_id_and_refusals(capsys):
    assert parse_args(["--base-gpu-id", "2"]).base_gpu_id == 2
    args = parse_args(["--dp-size", "2", "--tp-size", "2"])
    assert (args.dp_size, args.tp_size) == (2, 2)
    for argv, why in ((["--dp-size", "2", "--tp-size", "2", "--nnodes", "2",
                        "--dist-init-addr", "h:1"], "SGLang's router"),
                      (["--dp-size", "2", "--tp-size", "2", "--dist-init-addr", "h:65535"],
                       "PORT + dp_size - 1"),
                      (["--base-gpu-id", "-1"], "base_gpu_id=-1")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert why in capsys.readouterr().err


# A live server: two replicas of two ranks.
@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # float32 on every CPU: under bf16 products (`auto` with avx512_bf16 or AMX) TP's partial
    # sums round differently and a tiny random model's greedy ids may part from one process's.
    srv = ServerProcess(tiny_llama_dir, "--dp-size", "2", "--tp-size", "2", "--num-threads", "1",
                        "--max-total-tokens", "512", "--max-running-requests", "4",
                        "--dtype", "float32")
    yield srv.wait_ready(timeout=300)
    srv.stop()


def replicas(http) -> list[dict]:
    return http.get("/get_server_info").json()["replicas"]


def test_two_tp_replicas_answer_like_one_process(server, tiny_llama_dir):
    with server.client() as http:
        before = replicas(http)

        def one(ids: list[int]) -> list[int]:
            r = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY})
            assert r.status_code == 200, r.text
            return r.json()["output_ids"]

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(one, PROMPTS))
        after = replicas(http)
    with Engine(model_path=tiny_llama_dir, max_total_tokens=512, dtype="float32") as engine:
        want = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS,
                                                         sampling_params=GREEDY)]
    assert got == want
    sent = [a["dispatched_requests"] - b["dispatched_requests"] for a, b in zip(after, before)]
    assert sum(sent) == len(PROMPTS) and min(sent) >= 1, sent  # both replicas took requests
    assert [r["tp_size"] for r in after] == [2, 2]
    assert all(len(r["tp_rank_pids"]) == 1 for r in after)
    pids = {r["pid"] for r in after} | {p for r in after for p in r["tp_rank_pids"]}
    assert len(pids) == 4  # four model processes
    addrs = [r["dist_init_addr"] for r in after]
    assert addrs[0] != addrs[1] and all(a.startswith("127.0.0.1:") for a in addrs), addrs
    if (os.cpu_count() or 1) < 4:
        assert "--dp-size 2 x --tp-size 2 x --num-threads 1 = 4 torch threads" in server.log()


def test_a_killed_rank_of_one_replica_ends_the_server(server):
    """Kept last: it ends the module's server."""
    with server.client() as http:
        victim = replicas(http)[1]["tp_rank_pids"][0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.proc.poll() not in (None, 0), "the server did not exit after the rank died"
    log = server.log()
    assert "tensor parallel rank process airserve-dp1-tp1" in log, log[-3000:]
    assert "exited with code -9" in log and "data-parallel replica 1" in log, log[-3000:]
