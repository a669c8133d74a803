"""CUDA decode graphs: one `torch.cuda.CUDAGraph` per bucket, all in one shared memory pool.

With `--enable-torch-compile`, buckets <= `--torch-compile-max-bs` capture a `torch.compile`d
forward (inductor without its own cudagraphs) inside the graph, as SGLang does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from airserve.srt.forward_batch import ForwardBatch
from airserve.srt.layers.attention.torch_native_backend import static_decode_width
from airserve.srt.model_executor.graph_runners.base import GraphRunner, configure_compile_cache

WARMUP_RUNS = 2  # before capture: compiles, autotunes and allocates outside the graph


class CudaGraphRunner(GraphRunner):
    outputs_reused = True  # a graph's output buffer is rewritten by its next replay

    def __init__(self, model_runner) -> None:
        self.device_module = self.get_device_module()
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.stream = None
        config = model_runner.runner_config
        self.compile_max_bs = config.torch_compile_max_bs if config.enable_torch_compile else 0
        if config.enable_torch_compile:
            configure_compile_cache(config.compile_cache_dir)
        super().__init__(model_runner)

    # Device specifics (NPUGraphRunner overrides these).
    def get_device_module(self):
        return torch.cuda

    def create_graph(self):
        return torch.cuda.CUDAGraph()

    def graph_context(self, graph):
        return torch.cuda.graph(graph, pool=self.pool, stream=self.stream)

    def memory_in_use(self) -> int:
        self.device_module.synchronize()
        free, total = self.device_module.mem_get_info()
        return total - free

    # Contract.
    def forward_for_bucket(self, bs: int) -> Callable[[ForwardBatch], torch.Tensor]:
        if bs > self.compile_max_bs:
            return self.forward_static
        import torch._inductor.config as inductor_config

        inductor_config.triton.cudagraphs = False  # the runner owns the graphs
        return torch.compile(self.forward_static, backend=self.backend_name, fullgraph=True,
                             dynamic=False, mode="max-autotune-no-cudagraphs"
                             if self.backend_name == "inductor" else None)

    def capture_bucket(self, bs: int, fb: ForwardBatch) -> None:
        dm = self.device_module
        if self.stream is None:
            self.stream = dm.Stream()
            self.pool = dm.graph_pool_handle()
        forward = self.forward_for_bucket(bs)
        # Warm-up at the captured shapes: lazy allocations (cuDNN plans) cannot run in a capture.
        with dm.stream(self.stream), static_decode_width():
            for _ in range(WARMUP_RUNS):
                forward(fb)
        dm.synchronize()
        graph = self.create_graph()
        with self.graph_context(graph):
            out = forward(fb)
        dm.synchronize()
        self.graphs[bs] = graph
        self.outputs[bs] = out

    def replay_bucket(self, bs: int, fb: ForwardBatch) -> torch.Tensor:
        self.graphs[bs].replay()
        return self.outputs[bs]
