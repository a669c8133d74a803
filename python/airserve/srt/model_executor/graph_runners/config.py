"""What a graph runner is told: a small frozen config built once from ServerArgs.

Defaults and validation stay in ServerArgs; every field here is filled by `from_server_args`.

Runners read this, never `ServerArgs`: a runner's inputs are this config and the model runner's
model, attention backend and KV cache. A new runner option is a field here and one line in
`from_server_args`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from airserve.srt.server_args import ServerArgs


@dataclass(frozen=True)
class RunnerConfig:
    device: str
    enable_torch_compile: bool
    compile_backend: str  # resolved per device
    disable_cuda_graph: bool
    padding: bool  # False: a batch replays only in a bucket of exactly its size
    # Buckets: explicit sizes, or a schedule up to a max (compiled runners use the compile max).
    cuda_graph_bs: tuple[int, ...] | None
    cuda_graph_max_bs: int | None
    torch_compile_max_bs: int
    compile_cache_dir: str | None  # inductor's on-disk cache
    model_path: str  # part of TorchAirRunner's compile-cache key
    graph_flags: str  # the flags that can change a compiled graph, part of compile-cache keys
    # TorchAirRunner.
    torchair_mode: str
    torchair_cache_dir: str | None
    torchair_frozen_parameter: bool
    torchair_tiling_schedule_optimize: bool
    # OpenVINORunner.
    openvino_device: str
    openvino_precision: str
    openvino_cache_dir: str | None
    openvino_num_threads: int | None  # --openvino-num-threads, else --num-threads
    openvino_weights: str
    openvino_dynamic_quant_group_size: int
    openvino_static_kv_len: int

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> RunnerConfig:
        return cls(
            device=args.device, enable_torch_compile=args.enable_torch_compile,
            compile_backend=args.resolved_compile_backend,
            disable_cuda_graph=args.disable_cuda_graph,
            padding=not args.disable_cuda_graph_padding, cuda_graph_bs=args.cuda_graph_bs,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            torch_compile_max_bs=args.torch_compile_max_bs,
            compile_cache_dir=args.compile_cache_dir,
            model_path=str(args.model_path or "default"),
            graph_flags=graph_flags(args),
            torchair_mode=args.torchair_mode, torchair_cache_dir=args.torchair_cache_dir,
            torchair_frozen_parameter=args.torchair_frozen_parameter,
            torchair_tiling_schedule_optimize=args.torchair_tiling_schedule_optimize,
            openvino_device=args.openvino_device, openvino_precision=args.openvino_precision,
            openvino_cache_dir=args.openvino_cache_dir,
            openvino_num_threads=args.openvino_num_threads or args.num_threads,
            openvino_weights=args.openvino_weights,
            openvino_dynamic_quant_group_size=args.openvino_dynamic_quant_group_size,
            openvino_static_kv_len=args.openvino_static_kv_len,
        )

    @property
    def resolved_model_path(self) -> str | None:
        return None if self.model_path == "default" else self.model_path

    @property
    def backend_name(self) -> str:
        """The compile backend for reports: "none" when torch.compile is off."""
        return self.compile_backend if self.enable_torch_compile else "none"


# ServerArgs fields that cannot change a compiled decode graph; every other field is part of
# compile-cache keys (a new flag counts until it is listed here). The KV pool's size is checked
# per graph input instead (mem_fraction_static, max_total_tokens).
NOT_IN_GRAPH = frozenset({
    "tokenizer_path", "served_model_name", "random_seed", "mem_fraction_static",
    "max_total_tokens", "max_prefill_tokens", "disable_radix_cache", "schedule_policy",
    "chunked_prefill_size", "decode_chunked_prefill_size", "enable_mixed_chunk", "dp_size",
    "nnodes", "node_rank", "dist_init_addr", "dist_timeout", "compile_cache_dir", "host", "port",
    "api_key", "log_level", "enable_metrics", "skip_server_warmup", "max_request_body_bytes",
    "allowed_hosts",
})


def graph_flags(args: ServerArgs) -> str:
    """The ServerArgs fields that may change a compiled decode graph, as one sorted string."""
    fields = sorted((f.name, repr(getattr(args, f.name))) for f in dataclasses.fields(args)
                    if f.name not in NOT_IN_GRAPH and not f.name.startswith(("torchair_",
                                                                             "openvino_")))
    return ";".join(f"{k}={v}" for k, v in fields)
