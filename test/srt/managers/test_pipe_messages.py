"""The scheduler loop over a real pipe, in this process: typed messages in and out, bad requests
answered with ReqError, and a step that raises fails its requests while the loop lives on.
(The import rules, managers importing nothing from entrypoints among them, are checked in
test/srt/test_import_rules.py.)"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest

from airserve.srt.managers import io_struct as io
from airserve.srt.managers.engine_core import EngineCore
from airserve.srt.managers.scheduler_process import SchedulerLoop
from airserve.srt.server_args import ServerArgs


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    return EngineCore(ServerArgs(model_path=tiny_llama_dir, max_total_tokens=256,
                                 max_running_requests=4))


class LoopThread:
    """A SchedulerLoop in a thread, driven through a real Pipe pair."""

    def __init__(self, core) -> None:
        req_recv, self.send = mp.Pipe(duplex=False)
        self.recv, out_send = mp.Pipe(duplex=False)
        self.loop = SchedulerLoop(core, req_recv, out_send, os.getppid())
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()

    def until(self, predicate, timeout: float = 60.0) -> list:
        """Messages received until `predicate(msg)` holds for one of them."""
        got = []
        while self.recv.poll(timeout):
            got.append(self.recv.recv())
            if predicate(got[-1]):
                return got
        raise AssertionError(f"no such message in {timeout}s; got {len(got)}, the last: "
                             f"{got[-1:]}")

    def close(self) -> None:
        self.send.send(io.ShutdownReq())
        self.thread.join(10)
        assert not self.thread.is_alive()


def finished(rid: str):
    def check(msg) -> bool:
        return isinstance(msg, io.BatchOutput) and any(
            d.rid == rid and d.finished_reason for d in msg.deltas)
    return check


def errored(rid: str):
    def check(msg) -> bool:
        return isinstance(msg, io.BatchOutput) and any(e.rid == rid for e in msg.errors)
    return check


def test_typed_messages_both_ways(core):
    t = LoopThread(core)
    try:
        t.send.send(io.GenerateReqInput("a", [5, 6, 7], {"max_new_tokens": 4,
                                                         "temperature": 0}, stream=True))
        msgs = t.until(finished("a"))
        deltas = [d for m in msgs for d in m.deltas if d.rid == "a"]
        assert sum(len(d.new_output_ids) for d in deltas) == 4
        assert deltas[-1].finished_reason == {"type": "length", "length": 4}
        # Wrong type and out-of-range values: 400s naming the field, the loop goes on.
        t.send.send(io.GenerateReqInput("b", [5], {"temperature": "hot"}))
        # More than the pool (256 tokens), less than the context (512).
        t.send.send(io.GenerateReqInput("c", [5] * 100, {"max_new_tokens": 200}))
        errors = [e for m in t.until(errored("c")) for e in m.errors]
        by_rid = {e.rid: e for e in errors}
        assert by_rid["b"].status == 400 and "temperature" in by_rid["b"].message
        assert by_rid["c"].status == 400 and "--max-total-tokens" in by_rid["c"].message
        t.send.send(io.ServerInfoReq(token=7))
        reply = t.until(lambda m: isinstance(m, io.CallReply))[-1]
        assert reply.token == 7 and reply.ok
        assert reply.payload["kv_pool"]["tokens"] == 256
        assert reply.payload["stats"]["kv_used_pages"] == 0
    finally:
        t.close()


@pytest.mark.parametrize("method,on_call", [("next_batch", 3), ("_build_extend", 1)])
def test_a_step_that_raises_fails_its_requests_and_the_loop_goes_on(core, method, on_call):
    """Faults injected outside the per-request isolation: while building a decode step (the
    request is running) and while building its prefill (it is between the queues)."""
    t = LoopThread(core)
    sched = t.loop.scheduler
    original = getattr(sched, method)
    calls = {"n": 0}

    def fails_once(*args):
        calls["n"] += 1
        if calls["n"] == on_call:
            raise RuntimeError(f"injected fault in {method}")
        return original(*args)

    setattr(sched, method, fails_once)
    try:
        t.send.send(io.GenerateReqInput("x", [5, 6], {"max_new_tokens": 50, "temperature": 0,
                                                      "ignore_eos": True}))
        error = [e for m in t.until(errored("x")) for e in m.errors if e.rid == "x"][0]
        assert error.status == 500 and f"injected fault in {method}" in error.message
        t.send.send(io.GenerateReqInput("y", [5, 6], {"max_new_tokens": 3, "temperature": 0}))
        t.until(finished("y"))
        alloc, pool = core.model_runner.allocator, core.model_runner.req_to_token_pool
        # Every page is free or in the prefix cache (which can evict it): none leaked.
        assert sched.kv.audit(sched.holders())["owned"] == 0
        assert sched.kv.available_pages() == alloc.total_usable_pages
        assert pool.available_size() == pool.size
    finally:
        delattr(sched, method)  # the class method again
        t.close()
