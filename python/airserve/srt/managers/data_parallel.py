"""Data parallelism (`--dp-size N`): N scheduler processes behind one tokenizer manager.

Each replica is a whole engine in its own process: model, KV pool, prefix cache and batching
(`scheduler_process.py`), joined to the HTTP process by its own two pipes. With --tp-size M
that process is rank 0 of the replica's own tensor-parallel group of M processes, which meets
at its own address and runs on its own devices (`replica_args`). The tokenizer manager
sends each new request to the replica with the fewest queued tokens, its aborts to the replica
that owns it, and calls (server info, cache flush) to every replica. One replica dying ends the
server, as the one scheduler's death does without data parallelism.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from airserve.srt.managers import io_struct as io
from airserve.srt.managers.scheduler_process import run_scheduler_process
from airserve.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def replica_init_addr(args: ServerArgs, dp_rank: int) -> str | None:
    """Where replica `dp_rank`'s ranks meet: --dist-init-addr's port + dp_rank, so that the
    replicas' groups never share a rendezvous; None (each replica's rank 0 then picks a free
    loopback port in its own process, `tp_worker.resolve_init_addr`) without the flag."""
    if args.dist_init_addr is None:
        return None
    host, _, port = args.dist_init_addr.rpartition(":")
    return f"{host}:{int(port) + dp_rank}"


@dataclass(eq=False)
class OpenReq:
    """What the dispatcher counts for one request that a replica still owns."""

    prompt_tokens: int
    max_new_tokens: int  # capped by the context: a request never produces more
    output_tokens: int = 0

    @property
    def queued_tokens(self) -> int:
        """Tokens this request still asks of its replica: its prompt until the first output
        token arrives (prefill done), then the outputs it may still produce."""
        prefill = self.prompt_tokens if self.output_tokens == 0 else 0
        return prefill + max(self.max_new_tokens - self.output_tokens, 0)


@dataclass(eq=False)
class Replica:
    """One scheduler process (rank `rank` of `--dp-size`), its pipes and its load."""

    rank: int
    server_args: ServerArgs
    proc: mp.Process | None = None
    info: dict = field(default_factory=dict)  # its SchedulerReady message
    stats: dict = field(default_factory=dict)  # its latest stats snapshot
    fatal: str | None = None  # the SchedulerFatal it sent, if any
    open_reqs: dict[str, OpenReq] = field(default_factory=dict)  # rid -> what it owes
    dispatched: int = 0  # requests sent to it since start

    def __post_init__(self) -> None:
        self._outbox: queue.Queue = queue.Queue()

    @property
    def name(self) -> str:
        return "the scheduler process" if self.server_args.dp_size == 1 \
            else f"data-parallel replica {self.rank}: the scheduler process"

    @property
    def queued_tokens(self) -> int:
        return sum(r.queued_tokens for r in self.open_reqs.values())

    # Life cycle.
    def start(self) -> None:
        """Spawn the scheduler process and the thread that feeds its pipe."""
        ctx = mp.get_context("spawn")  # never fork a process that may hold torch threads
        req_recv, self._req_send = ctx.Pipe(duplex=False)
        self._out_recv, out_send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=run_scheduler_process,
                                name=f"airserve-scheduler-{self.rank}",
                                args=(replica_args(self.server_args, self.rank), req_recv,
                                      out_send, os.getpid()))
        self.proc.start()
        req_recv.close()
        out_send.close()
        threading.Thread(target=self._send_loop, name=f"airserve-send-{self.rank}",
                         daemon=True).start()

    def wait_ready(self) -> dict:
        """Block until the model is loaded; raises RuntimeError saying why it was not."""
        failed = f"{self.name} exited (code {{}}) while loading the model; see its log above"
        while not self._out_recv.poll(0.5):
            if not self.proc.is_alive():
                raise RuntimeError(failed.format(self.proc.exitcode))
        try:
            msg = self._out_recv.recv()
        except EOFError:
            self.proc.join(1.0)
            raise RuntimeError(failed.format(self.proc.exitcode)) from None
        if not isinstance(msg, io.SchedulerReady):
            raise RuntimeError(f"loading the model failed: {getattr(msg, 'message', msg)}")
        self.info = msg.info
        return msg.info

    def start_reading(self, on_message: Callable[[Replica, object], None],
                      on_dead: Callable[[Replica, int | None], None]) -> None:
        """Read its messages on a thread; `on_message` and, once the pipe closes, `on_dead`
        are called from that thread (the caller moves them onto its event loop)."""
        threading.Thread(target=self._read_loop, args=(on_message, on_dead),
                         name=f"airserve-recv-{self.rank}", daemon=True).start()

    def send(self, msg: object) -> None:
        self._outbox.put(msg)

    def close(self, timeout: float) -> None:
        """Stop the process (politely, then by force) and wait for it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.is_alive() and self.info:
            self._outbox.put(io.ShutdownReq())
            self._outbox.put(None)
            proc.join(timeout)
        elif proc.is_alive():  # still loading the model: nothing to finish politely
            timeout = 0
        if proc.is_alive():
            if timeout:
                logger.warning("%s did not stop in %.0fs; terminating it", self.name, timeout)
            proc.terminate()
            proc.join(2)
        if proc.is_alive():
            proc.kill()
            proc.join()

    # Load.
    def report(self) -> dict:
        """Its load as the dispatcher sees it, with its scheduler's latest counters."""
        cache = self.stats.get("prefix_cache", {})
        return {
            "dp_rank": self.rank,
            "pid": self.info.get("pid"),
            "queued_tokens": self.queued_tokens,
            "open_requests": len(self.open_reqs),
            "dispatched_requests": self.dispatched,
            "num_running_reqs": self.stats.get("num_running_reqs", 0),
            "num_waiting_reqs": self.stats.get("num_waiting_reqs", 0),
            "kv_total_tokens": self.stats.get("kv_total_tokens", 0),
            "kv_used_tokens": self.stats.get("kv_used_tokens", 0),
            "cache_hit_rate": cache.get("hit_rate", 0.0),
            "finished_requests": self.stats.get("finished_requests", 0),
            "aborted_requests": self.stats.get("aborted_requests", 0),
        }

    # The two pipe threads.
    def _read_loop(self, on_message, on_dead) -> None:
        try:
            while True:
                on_message(self, self._out_recv.recv())
        except (EOFError, OSError):
            pass
        except RuntimeError:  # the event loop is closed: the server is gone already
            return
        proc = self.proc
        if proc is not None:
            proc.join(1.0)
        try:
            on_dead(self, proc.exitcode if proc is not None else None)
        except RuntimeError:
            pass

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._req_send.send(msg)
            except OSError:  # the scheduler is gone; the read loop reports it
                return


def replica_args(args: ServerArgs, rank: int) -> ServerArgs:
    """The arguments replica `rank`'s processes run with: its dp_rank (which picks its devices,
    `tp_worker.device_index`) and its own --dist-init-addr port (PORT + rank)."""
    return args.replace(dp_rank=rank, dist_init_addr=replica_init_addr(args, rank))


def pick_replica(replicas: list[Replica], start: int) -> Replica:
    """The replica with the fewest queued tokens; ties go to fewer open requests, then to
    the first at or after `start` (a rotating offset, so an idle server spreads its load)."""
    n = len(replicas)
    order = [replicas[(start + i) % n] for i in range(n)]
    return min(order, key=lambda r: (r.queued_tokens, len(r.open_reqs)))


def check_threads(dp_size: int, num_threads: int | None, cpu_count: int | None,
                  tp_size: int = 1) -> str | None:
    """A warning when the model processes' torch threads together (dp_size replicas of tp_size
    ranks, each process its own threads) exceed the CPUs, else None."""
    procs = dp_size * tp_size
    if procs == 1 or not cpu_count:
        return None
    threads = num_threads or cpu_count  # torch's default: one thread per CPU
    if procs * threads <= cpu_count:
        return None
    given = f"--num-threads {num_threads}" if num_threads else f"{threads} (torch's default)"
    sizes = f"--dp-size {dp_size} x --tp-size {tp_size}" if tp_size > 1 else f"--dp-size {dp_size}"
    fix = (f"set --num-threads to at most {cpu_count // procs}" if cpu_count >= procs else
           "use fewer replicas or ranks")
    return (f"{sizes} x {given} = {procs * threads} torch threads on {cpu_count} CPUs: the "
            f"model processes will contend for cores; {fix} (each replica and each rank runs "
            "its own threads)")
