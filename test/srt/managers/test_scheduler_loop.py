"""The scheduler process's loop never waits for messages while a batch runs: each step polls
its pipe without a timeout, and one message goes out per step."""

from __future__ import annotations

import os
from multiprocessing import Pipe

from airserve.srt.managers import io_struct as io
from airserve.srt.managers.engine_core import EngineCore
from airserve.srt.managers.scheduler_process import NON_STREAM_INTERVAL, SchedulerLoop
from airserve.srt.server_args import ServerArgs

NEW_TOKENS = 6


class RecordingConn:
    """The loop's end of the request pipe: hands it `msgs` one by one, then ShutdownReq once
    the scheduler has nothing left to do, and records every poll's timeout and whether the
    scheduler had work at that moment."""

    def __init__(self, scheduler, msgs: list) -> None:
        self.scheduler = scheduler
        self.msgs = list(msgs)
        self.polls: list[tuple[float, bool]] = []
        self.steps_seen = False

    def poll(self, timeout: float = 0.0) -> bool:
        busy = self.scheduler.has_work()
        self.steps_seen = self.steps_seen or busy
        self.polls.append((timeout, busy))
        if self.msgs:
            return True
        if self.steps_seen and not busy:
            self.msgs.append(io.ShutdownReq())
            return True
        return False

    def recv(self) -> object:
        return self.msgs.pop(0)


def test_the_loop_never_waits_for_messages_while_requests_run(tiny_llama_dir):
    core = EngineCore(ServerArgs(model_path=tiny_llama_dir, max_total_tokens=1024,
                                 max_running_requests=4))
    req = io.GenerateReqInput("r1", [5, 6, 7, 8], {"max_new_tokens": NEW_TOKENS,
                                                   "temperature": 0, "ignore_eos": True})
    conn = RecordingConn(core.scheduler, [req])
    out_recv, out_send = Pipe(duplex=False)
    loop = SchedulerLoop(core, conn, out_send, os.getppid())
    loop.run()
    busy_timeouts = [timeout for timeout, busy in conn.polls if busy]
    assert len(busy_timeouts) >= NEW_TOKENS  # one poll per step at least
    assert set(busy_timeouts) == {0}, conn.polls
    tokens, finished = 0, None
    while out_recv.poll(0):
        msg = out_recv.recv()
        for delta in msg.deltas:
            tokens += len(delta.new_output_ids)
            finished = delta.finished_reason or finished
    assert tokens == NEW_TOKENS
    assert finished == {"type": "length", "length": NEW_TOKENS}


def _deltas(tiny_llama_dir: str, stream: bool, new_tokens: int) -> list[io.ReqDelta]:
    core = EngineCore(ServerArgs(model_path=tiny_llama_dir, max_total_tokens=1024,
                                 max_running_requests=4))
    req = io.GenerateReqInput("r1", [5, 6, 7, 8], {"max_new_tokens": new_tokens,
                                                   "temperature": 0, "ignore_eos": True},
                              stream=stream)
    out_recv, out_send = Pipe(duplex=False)
    SchedulerLoop(core, RecordingConn(core.scheduler, [req]), out_send, os.getppid()).run()
    deltas = []
    while out_recv.poll(0):
        deltas += [d for d in out_recv.recv().deltas if d.new_output_ids or d.finished_reason]
    return deltas


def test_a_request_that_does_not_stream_gets_few_messages_and_all_its_tokens(tiny_llama_dir):
    n = NON_STREAM_INTERVAL + 10
    quiet = _deltas(tiny_llama_dir, stream=False, new_tokens=n)
    streamed = _deltas(tiny_llama_dir, stream=True, new_tokens=n)
    # The first token at once, one delta after NON_STREAM_INTERVAL more, then the last.
    assert [len(d.new_output_ids) for d in quiet] == [1, NON_STREAM_INTERVAL,
                                                      n - 1 - NON_STREAM_INTERVAL]
    assert len(streamed) == n
    for deltas in (quiet, streamed):
        assert [t for d in deltas for t in d.new_output_ids] == \
            [t for d in streamed for t in d.new_output_ids]
        assert deltas[-1].finished_reason == {"type": "length", "length": n}
        assert _text(deltas) == _text(streamed)


def _text(deltas: list[io.ReqDelta]) -> str:
    text = ""
    for d in deltas:
        text = text[:d.text_offset] + d.text
    return text
