"""CPU decode graphs: one `torch.compile`d (inductor) decode callable per bucket.

Default buckets are powers of two (1, 2, 4, ... up to `--torch-compile-max-bs`), not SGLang's
denser schedule: every bucket is a separate inductor compile (measured on 2 cores, SmolLM2-135M:
about a minute cold, 4-10 s warm from inductor's on-disk cache, see `--compile-cache-dir`), and a
padded row costs far less than a compile. `--cuda-graph-bs` still picks any sizes.

No recompiles after capture: every bucket has fixed shapes (`dynamic=False`), the KV buffers
are marked static, and dynamo's recompile limit is raised to fit the buckets (the limit is
shared by every wrapper of the model's `forward`; past it dynamo silently runs eager).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from airserve.srt.forward_batch import ForwardBatch
from airserve.srt.model_executor.graph_runners.base import (
    GraphRunner,
    configure_compile_cache,
    dynamo_graph_count,
    power_of_two_buckets,
)


class CPUGraphRunner(GraphRunner):
    compile_runner = True
    schedule = staticmethod(power_of_two_buckets)

    def __init__(self, model_runner) -> None:
        configure_compile_cache(model_runner.runner_config.compile_cache_dir)
        self.compiled: dict[int, Callable[[ForwardBatch], torch.Tensor]] = {}
        self.graphs_at_capture = 0
        for buf in model_runner.kv_cache.k_buffers + model_runner.kv_cache.v_buffers:
            torch._dynamo.mark_static_address(buf)
        super().__init__(model_runner)

    def capture_bucket(self, bs: int, fb: ForwardBatch) -> None:
        fn = torch.compile(self.forward_static, backend=self.backend_name, fullgraph=True,
                           dynamic=False)
        fn(fb)  # compiles; the dummy-slot writes of the all-padding batch are harmless
        self.compiled[bs] = fn
        self.graphs_at_capture = dynamo_graph_count()

    def replay_bucket(self, bs: int, fb: ForwardBatch) -> torch.Tensor:
        # Full guard evaluation checks every weight and KV buffer (~1 ms a step on 2 cores);
        # only the guards that tell the buckets apart (input shapes) can differ here, since
        # the model, the KV buffers and the static batches never change after capture.
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return self.compiled[bs](fb)

    def recompiles_since_capture(self) -> int:
        return dynamo_graph_count() - self.graphs_at_capture

    def report(self) -> dict:
        report = super().report()
        report["recompiles_since_capture"] = self.recompiles_since_capture()
        return report
