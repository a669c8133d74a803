"""CPU decode graphs: one `torch.compile`d (inductor) decode graph per bucket, replayed without
dynamo.

Default buckets are powers of two (1, 2, 4, ... up to `--torch-compile-max-bs`), not SGLang's
denser schedule: every bucket is a separate inductor compile (measured on 2 cores, SmolLM2-135M:
about a minute cold, 4-10 s warm from inductor's on-disk cache, see `--compile-cache-dir`), and a
padded row costs far less than a compile. `--cuda-graph-bs` still picks any sizes.

Replay calls each bucket's compiled graph directly with the tensors it was compiled on (the
model's weights, the KV buffers and the bucket's static batch, all at fixed addresses), so no
dynamo frame runs per step: no guard evaluation, no cache lookup, no input flattening (~1-2 ms
a step on 2 cores). The first replay of a bucket still goes through dynamo and checks that
dynamo hands the graph those tensors (or views of the same memory, which the capture-time
tensors keep alive); a bucket that fails the check keeps replaying through dynamo (guards
skipped), logged and counted in the report (`dynamo_replays`).

No recompiles after capture: every bucket has fixed shapes (`dynamic=False`), the KV buffers
are marked static, and dynamo's recompile limit is raised to fit the buckets (the limit is
shared by every wrapper of the model's `forward`; past it dynamo silently runs eager).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from airserve.srt.forward_batch import ForwardBatch
from airserve.srt.model_executor.graph_runners.base import (
    GraphRunner,
    configure_compile_cache,
    dynamo_graph_count,
    power_of_two_buckets,
)

logger = logging.getLogger(__name__)


class CompiledGraph:
    """A bucket's compiled graph, as the backend returned it to dynamo; records the inputs and
    outputs of the last call that went through dynamo."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.args: tuple = ()
        self.outputs: object = None

    def __call__(self, *args):
        self.args = args
        self.outputs = self.fn(*args)
        return self.outputs

    def direct_call(self) -> Callable[[], torch.Tensor] | None:
        """A call of the graph on the recorded inputs, returning what dynamo returned (the
        logits, the graph's only output), or None if the recorded call does not allow it."""
        outs = self.outputs
        if not isinstance(outs, (list, tuple)) or len(outs) != 1:
            return None
        fn, args = self.fn, self.args
        return lambda: fn(*args)[0]


def same_memory(x: torch.Tensor, y: torch.Tensor) -> bool:
    """x and y read the same elements: the same tensor, or a view of the same memory with the
    same layout (the attention backend makes new views of its static tables every step)."""
    return x is y or (x.data_ptr() == y.data_ptr() and x.shape == y.shape
                      and x.stride() == y.stride() and x.dtype == y.dtype
                      and x.device == y.device)


def same_inputs(a: tuple, b: tuple) -> bool:
    """The same tensors' memory (and equal other values) in the same order."""
    return len(a) == len(b) and all(
        same_memory(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        else type(x) is type(y) and x == y
        for x, y in zip(a, b))


class CPUGraphRunner(GraphRunner):
    compile_runner = True
    schedule = staticmethod(power_of_two_buckets)

    def __init__(self, model_runner) -> None:
        configure_compile_cache(model_runner.runner_config.compile_cache_dir)
        self.compiled: dict[int, Callable[[ForwardBatch], torch.Tensor]] = {}
        self.graphs: dict[int, CompiledGraph] = {}
        self.capture_args: dict[int, tuple] = {}
        self.direct: dict[int, Callable[[], torch.Tensor]] = {}
        self.direct_refused: dict[int, str] = {}
        self.dynamo_replays = 0
        self.graphs_at_capture = 0
        for buf in model_runner.kv_cache.k_buffers + model_runner.kv_cache.v_buffers:
            torch._dynamo.mark_static_address(buf)
        super().__init__(model_runner)

    def capture_bucket(self, bs: int, fb: ForwardBatch) -> None:
        backend = torch._dynamo.lookup_backend(self.backend_name)
        graphs: list[CompiledGraph] = []

        def recording_backend(gm, example_inputs):
            graphs.append(CompiledGraph(backend(gm, example_inputs)))
            return graphs[-1]

        fn = torch.compile(self.forward_static, backend=recording_backend, fullgraph=True,
                           dynamic=False)
        fn(fb)  # compiles; the dummy-slot writes of the all-padding batch are harmless
        if len(graphs) != 1:
            raise RuntimeError(f"expected one compiled graph for the decode step, got "
                               f"{len(graphs)}")
        self.compiled[bs] = fn
        self.graphs[bs] = graphs[0]
        self.capture_args[bs] = graphs[0].args
        self.graphs_at_capture = dynamo_graph_count()

    def replay_bucket(self, bs: int, fb: ForwardBatch) -> torch.Tensor:
        direct = self.direct.get(bs)
        if direct is not None:
            return direct()
        # Through dynamo. Full guard evaluation checks every weight and KV buffer (~1 ms a step
        # on 2 cores); only the guards that tell the buckets apart (input shapes) can differ
        # here, since the model, the KV buffers and the static batches never change.
        self.dynamo_replays += 1
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            logits = self.compiled[bs](fb)
        if bs not in self.direct_refused:
            self.enable_direct(bs, logits)
        return logits

    def enable_direct(self, bs: int, logits: torch.Tensor) -> None:
        """After a replay through dynamo: replay `bs` directly from now on if dynamo gave the
        graph the tensors it was compiled on and returned its output unchanged."""
        graph = self.graphs[bs]
        direct = graph.direct_call()
        if not same_inputs(graph.args, self.capture_args[bs]):
            reason = "dynamo passed the graph other inputs than at capture"
        elif direct is None or graph.outputs[0] is not logits:
            reason = "the graph's outputs are not the decode step's logits"
        else:
            self.direct[bs] = direct
            return
        self.direct_refused[bs] = reason
        logger.warning("CPUGraphRunner: bucket %d replays through dynamo: %s", bs, reason)

    def recompiles_since_capture(self) -> int:
        return dynamo_graph_count() - self.graphs_at_capture

    def report(self) -> dict:
        report = super().report()
        report["recompiles_since_capture"] = self.recompiles_since_capture()
        report["direct_replay_buckets"] = sorted(self.direct)
        report["dynamo_replays"] = self.dynamo_replays
        if self.direct_refused:
            report["direct_replay_refused"] = dict(self.direct_refused)
        return report
