"""Tensor-parallel ranks other than 0, and how rank 0 drives them.

Rank 0 runs the scheduler. Before each forward pass it broadcasts a `BatchDescription` (the
ForwardBatch's host values plus the KV slots of every sequence in it) over a control group;
every other rank rebuilds the same ForwardBatch over its own KV pool (its own KV heads, same
slots) and runs the same forward, so the collectives inside the model line up. The logits are
gathered on every rank; only rank 0 samples.

Failure: a forward that raises on any rank leaves the ranks out of step, so it is fatal
(`TensorParallelError`); rank 0 also checks its local ranks' processes before every batch and
while idle, and a collective that waits past --dist-timeout raises. A rank whose rank 0 went
away sees its broadcast fail and exits.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import signal
import socket
import traceback
from dataclasses import dataclass

import torch

from airserve.srt.distributed.errors import TensorParallelError
from airserve.srt.forward_batch import ForwardBatch, ForwardMode
from airserve.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# The control group waits for the next batch for as long as the server is idle.
CONTROL_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class BatchDescription:
    """What a rank needs to rebuild rank 0's ForwardBatch (host values only)."""

    mode: int
    input_ids: list[int]
    positions: list[int]
    req_pool_indices: list[int]
    seq_lens: list[int]
    out_cache_loc: list[int]
    slots: list[list[int]]  # the KV slots of each sequence, seq_len of them
    extend_seq_lens: list[int] | None
    extend_prefix_lens: list[int] | None
    last_token_indices: list[int] | None
    return_all_logits: bool


def describe(fb: ForwardBatch, req_to_token: torch.Tensor) -> BatchDescription:
    idx = fb.req_pool_indices.tolist()
    return BatchDescription(
        int(fb.forward_mode), fb.input_ids.tolist(), fb.positions.tolist(), idx,
        list(fb.seq_lens_cpu), fb.out_cache_loc.tolist(),
        [req_to_token[r, :n].tolist() for r, n in zip(idx, fb.seq_lens_cpu)],
        fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu,
        None if fb.last_token_indices is None else fb.last_token_indices.tolist(),
        fb.return_all_logits)


def rebuild(runner, desc: BatchDescription) -> ForwardBatch:
    """Write the sequences' KV slots into this rank's request table; the ForwardBatch."""
    table = runner.allocator.req_to_token
    for r, slots in zip(desc.req_pool_indices, desc.slots):
        table[r, :len(slots)] = torch.tensor(slots, dtype=table.dtype, device=table.device)
    loc = torch.tensor(desc.out_cache_loc, dtype=torch.int64)
    return runner.make_forward_batch(
        ForwardMode(desc.mode), input_ids=desc.input_ids, positions=desc.positions,
        req_pool_indices=desc.req_pool_indices, seq_lens=desc.seq_lens, out_cache_loc=loc,
        extend_seq_lens=desc.extend_seq_lens, extend_prefix_lens=desc.extend_prefix_lens,
        last_token_indices=desc.last_token_indices, return_all_logits=desc.return_all_logits)


class ControlChannel:
    """Rank 0's batches to the other ranks, over a gloo group that never times out."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    def send(self, msg: object) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([msg], src=0, group=self.group)

    def recv(self) -> object:
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


STOP = "stop"


def device_index(args: ServerArgs, tp_rank: int) -> int:
    """The cuda/npu device (on its machine) of rank `tp_rank` of replica `args.dp_rank`: each
    replica takes the next tp_size / nnodes devices from --base-gpu-id on, one per local rank."""
    per_node = args.tp_size // args.nnodes
    return args.base_gpu_id + args.dp_rank * per_node + tp_rank % per_node


def resolve_init_addr(args: ServerArgs) -> ServerArgs:
    """args with a dist_init_addr: a free loopback port when all ranks are on this machine.
    Called by rank 0 in its own process (a replica's scheduler process), so each replica
    picks its own port."""
    if args.dist_init_addr is not None:
        return args
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return args.replace(dist_init_addr=f"127.0.0.1:{port}")


def rank_label(args: ServerArgs, rank: int) -> str:
    """How processes and logs name tensor-parallel rank `rank` (and its --dp-size replica)."""
    return f"dp{args.dp_rank}-tp{rank}" if args.dp_size > 1 else f"tp{rank}"


def spawn_local_ranks(args: ServerArgs) -> list[mp.Process]:
    """Start this machine's ranks other than its first (rank 0 on node 0 is the caller)."""
    per_node = args.tp_size // args.nnodes
    first = args.node_rank * per_node
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(first + (1 if args.node_rank == 0 else 0), first + per_node):
        proc = ctx.Process(target=run_tp_rank, args=(args, rank), daemon=True,
                           name=f"airserve-{rank_label(args, rank)}")
        proc.start()
        procs.append(proc)
    return procs


def check_ranks(procs: list[mp.Process]) -> None:
    """Raise TensorParallelError if one of `procs` has exited."""
    for proc in procs:
        if proc.exitcode is not None:
            raise TensorParallelError(
                f"tensor parallel rank process {proc.name} (pid {proc.pid}) exited with code "
                f"{proc.exitcode}; the ranks cannot go on without it")


def run_tp_rank(args: ServerArgs, rank: int) -> None:
    """Process entry point of a rank other than 0: load this rank's shard, then run every
    batch rank 0 broadcasts until it says stop or goes away."""
    from airserve.srt.managers.scheduler_process import configure_logging
    from airserve.srt.model_executor.model_runner import ModelRunner

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(args.log_level, rank_label(args, rank))
    try:
        runner = ModelRunner(args, tp_rank=rank)
    except Exception:  # noqa: BLE001 - reported, then the process exits
        logger.error("tensor parallel rank %d failed to load:\n%s", rank, traceback.format_exc())
        raise SystemExit(1) from None
    try:
        while True:
            msg = runner.tp_control.recv()
            if msg == STOP:
                break
            runner.forward_local(rebuild(runner, msg))
    except Exception as e:  # noqa: BLE001 - rank 0 went away, or a forward failed here
        logger.error("tensor parallel rank %d stops (rank 0 went away or a forward pass "
                     "failed): %s: %s", rank, type(e).__name__, e)
        logger.debug("%s", traceback.format_exc())
        raise SystemExit(1) from None
    logger.info("tensor parallel rank %d stops (rank 0 said stop)", rank)
    import torch.distributed as dist

    dist.destroy_process_group()


def run_node_ranks(args: ServerArgs) -> int:
    """`launch_server --node-rank K` (K > 0): run this machine's ranks until they exit."""
    from airserve.srt.managers.scheduler_process import configure_logging

    configure_logging(args.log_level, f"node{args.node_rank}")
    procs = spawn_local_ranks(args)
    logger.info("node %d runs tensor parallel ranks %s (pids %s)", args.node_rank,
                [p.name for p in procs], [p.pid for p in procs])
    code = 0
    for proc in procs:
        proc.join()
        code = code or (proc.exitcode or 0)
    return code

