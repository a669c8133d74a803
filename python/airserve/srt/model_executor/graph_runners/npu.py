"""Ascend decode graphs: `torch.npu.NPUGraph` per bucket, with the FIA host seq lengths patched
on every replay.

FIA (`npu_fused_infer_attention_score`) takes `actual_seq_lengths_kv` as a host list and tiles
by it, so a captured graph would keep the lengths it saw at capture. Graphs are captured with
`auto_dispatch_capture=True` and `graph.update(cpu_update_input=...)` rewrites those lengths
while the graph replays. The attention backend names the argument through `host_seq_lens_arg`.
"""

from __future__ import annotations

import threading

import torch

from airserve.srt.forward_batch import ForwardBatch
from airserve.srt.hardware import import_torch_npu
from airserve.srt.model_executor.graph_runners.cuda import CudaGraphRunner

# The FIA argument that carries the per-request KV lengths on the host.
DEFAULT_HOST_SEQ_LENS_ARG = "actual_seq_lengths_kv"


class NPUGraphRunner(CudaGraphRunner):
    def get_device_module(self):
        import_torch_npu()
        return torch.npu

    def create_graph(self):
        return torch.npu.NPUGraph()

    def graph_context(self, graph):
        return torch.npu.graph(graph, pool=self.pool, stream=self.stream,
                               auto_dispatch_capture=True)

    def host_seq_lens_arg(self) -> str:
        return getattr(self.attn_backend, "host_seq_lens_arg", DEFAULT_HOST_SEQ_LENS_ARG)

    def update_host_seq_lens(self, bs: int, seq_lens_cpu: list[int]) -> None:
        """Rewrite the captured FIA host lengths of bucket `bs` (padded rows: 1)."""
        self.graphs[bs].update(cpu_update_input=[{self.host_seq_lens_arg(): seq_lens_cpu}])

    def replay_bucket(self, bs: int, fb: ForwardBatch) -> torch.Tensor:
        # `fb.seq_lens_cpu` is the static batch's list: real lengths, then 1 per padded row.
        # The update runs on the host while the graph's launch is queued, as in SGLang.
        update = threading.Thread(target=self.update_host_seq_lens, args=(bs, fb.seq_lens_cpu))
        update.start()
        self.graphs[bs].replay()
        update.join()
        return self.outputs[bs]
