"""Decode graphs compiled by OpenVINO (Intel CPU, GPU, NPU): one per batch size, any KV length.

Batch size is bucketed as in every runner (powers of two by default). KV length is a dynamic
dimension of each graph: a step gathers a fixed number of cached tokens per row, `kv_len` =
block-table columns * page size, from a ladder 256, 512, 1024, ... up to the context length,
the smallest width that covers the longest live sequence. So the work per step follows the live
context (within 2x), never the context length or the KV pool size. The graph is traced once
per batch size with the block table's width symbolic; each (batch size, width) pair gets its own
infer request of that one compiled model, bound the first time a batch needs it (no compile, no
stall). The symbolic width costs OpenVINO ~20% a step, so each pair's graph is also compiled
again with its width a constant, on a worker thread (OpenVINO's compile alone, ~4 s, no
re-trace), and the pair switches to it when it is ready. Start-up compiles the static graphs of
the widths up to `--openvino-static-kv-len` tokens (default 256, the first) for every bucket;
a wider one compiles when a batch first needs it, and until then that batch runs the symbolic
graph on cores it shares with the compile: on a 2-core AMD EPYC (AVX2), W1's one stream
crossing 256 tokens ran ~5 s of 25-50 ms steps against ~15 ms before and after. The KV pool is
a graph input that OpenVINO reads in place (only through gathers; `_check_pool_reads` warns
otherwise).

The graph never writes the cache (OpenVINO loses in-place writes): it attends over the cached
tokens plus the new token's K/V and returns the new K/V, which `replay_bucket` writes at
`out_cache_loc` after the call (padded rows write the dummy slot). Outputs live in OpenVINO's
buffers, reused by the next call: the K/V are copied into the cache and the logits cloned.

Weights (`--openvino-weights`): with "packed" (the default) the graphs run a copy of the model
whose GGUF-block linear layers are `OpenVINOLinear`s, which OpenVINO compiles to matmuls over
u4/i8 constants (airserve.srt.layers.quant.openvino_linear); "float", or a checkpoint without
blocks, keeps the float32 weights.

Compile cost: each bucket's graph is a full trace and OpenVINO compile (default model, 2 cores:
~30 s packed, ~17 s float32), all at start-up; a static graph is OpenVINO's compile alone
(3-9 s). Each compiled model holds its own copy of the weights in the plugin's layout. A
compile's temporaries are returned to the OS afterwards (`trim_heap`): without that, the
process kept ~0.9 GB more per static compile of the default model.

Replay calls a `BoundRequest`: an OpenVINO infer request of the verified compiled model whose
inputs are the static decode tensors, the block table of its width (with that width as the
graph's size input) and the KV pool, shared in place.
"""

from __future__ import annotations

import bisect
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from airserve.srt.forward_batch import ForwardBatch, ForwardMode, KVCache
from airserve.srt.hardware import check_openvino_device, require_openvino
from airserve.srt.layers.attention.openvino_backend import (
    OpenVINOAttnBackend,
    OpenVINODecodeMetadata,
)
from airserve.srt.layers.quant.openvino_linear import with_openvino_linears
from airserve.srt.model_executor.graph_runners.base import (
    GraphRunner,
    power_of_two_buckets,
    renamed_method,
    trim_heap,
)
from airserve.srt.model_executor.graph_runners.openvino.compile import (
    BoundRequest,
    OpenVINOCompiler,
    check_precision,
    compile_options,
)

logger = logging.getLogger(__name__)

SMALLEST_KV_LEN = 256
# Layer types that may read the KV-pool inputs in OpenVINO's runtime graph: an in-place reshape
# and gathers. Anything else touches the whole pool every step.
POOL_READERS = frozenset({"Reshape", "Gather"})


@dataclass
class DecodeGraph:
    """How replay runs one (batch size, KV width) pair: a request of its bucket's graph."""

    compiler: OpenVINOCompiler  # what compiled the bucket's graph; the verified OpenVINO model
    table: torch.Tensor  # [bs, kv_blocks] int32, the block-table input, refilled per step
    inputs: list[torch.Tensor]  # every tensor the graph reads, the table and KV pool included
    dynamic: BoundRequest  # the bucket's graph; -> [logits, new K/V] in OpenVINO's buffers
    static: BoundRequest | None = None  # the graph compiled again for this width alone

    @property
    def run(self) -> BoundRequest:
        return self.static or self.dynamic

    @property
    def calls(self) -> int:
        return self.dynamic.calls + (self.static.calls if self.static else 0)


def kv_len_buckets(context_len: int, page_size: int,
                   smallest: int = SMALLEST_KV_LEN) -> list[int]:
    """KV-length buckets in block-table columns: 256, 512, ... tokens (rounded up to whole
    pages), always ending at the full context."""
    max_blocks = -(-context_len // page_size)
    blocks, n = [], smallest
    while n < context_len:
        blocks.append(-(-n // page_size))
        n *= 2
    return sorted(set(blocks) | {max_blocks})


class OpenVINORunner(GraphRunner):
    compile_runner = True
    schedule = staticmethod(power_of_two_buckets)  # every bucket is a slow compile
    outputs_reused = True  # logits live in OpenVINO's output buffer
    disabled_ops: tuple[str, ...] = ()  # ops kept out of OpenVINO (tests force a fallback)

    def __init__(self, model_runner) -> None:
        args = model_runner.runner_config
        require_openvino()
        self.ov_device = check_openvino_device(args.openvino_device)
        check_precision(self.ov_device, args.openvino_precision)
        self.options = compile_options(
            self.ov_device, args.openvino_precision, args.openvino_num_threads,
            args.openvino_cache_dir,
            disabled_ops=self.disabled_ops,
            dynamic_quant_group_size=args.openvino_dynamic_quant_group_size)
        if args.openvino_cache_dir:
            logger.info("--openvino-cache-dir %s: OpenVINO's compiled-blob cache (CACHE_DIR); "
                        "the backend's model_caching stays off (in openvino 2026.4.1 its cached "
                        "path fails on load and silently runs eager PyTorch)",
                        args.openvino_cache_dir)
        self.page_size = model_runner.kv_cache.page_size
        self.kv_blocks = kv_len_buckets(model_runner.context_len, self.page_size,
                                        SMALLEST_KV_LEN)
        self.ov_attn = OpenVINOAttnBackend(model_runner.allocator, model_runner.context_len)
        self.ov_model, self.packed_layers = model_runner.model, 0
        if args.openvino_weights == "packed":
            # int8 activations need integer zero points (see OpenVINOLinear).
            self.ov_model, self.packed_layers = with_openvino_linears(
                model_runner.model, zero_point=not args.openvino_dynamic_quant_group_size)
            if not self.packed_layers:
                logger.info("--openvino-weights packed: the model has no GGUF Q4_0/Q4_1/Q8_0 "
                            "blocks; OpenVINO graphs use its %s weights", model_runner.dtype)
        self.frozen = list(self.ov_model.parameters()) + list(self.ov_model.buffers())
        # Traced at one width, symbolic where there is more than one (dynamo specializes sizes
        # 0 and 1, so never at a width of one column).
        self.dynamic_kv = len(self.kv_blocks) > 1
        self.trace_blocks = next((b for b in self.kv_blocks if b > 1), self.kv_blocks[-1])
        self.compilers: dict[int, OpenVINOCompiler] = {}  # bs -> its compiled graph
        self.graphs: dict[tuple[int, int], DecodeGraph] = {}  # (bs, kv_blocks) -> request
        self.compile_seconds: dict[int, float] = {}
        # Static compiles of (bs, width) pairs, one at a time beside serving (see _request).
        self.static_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ov-static")
        self.static_pending: list[Future] = []
        self.static_seconds: dict[tuple[int, int], float] = {}
        self.static_failures = 0
        self.warned_pool_reads = False
        super().__init__(model_runner)

    # The compiled region: inputs are explicit, nothing is written.
    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor,
                    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        """Logits [bs, vocab] float32 and the new K/V [2 * layers, bs, KVH, D] (K then V)."""
        meta = OpenVINODecodeMetadata(block_table, seq_lens)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=input_ids.shape[0],
            input_ids=input_ids, positions=positions, req_pool_indices=None,
            seq_lens=seq_lens, seq_lens_cpu=[], out_cache_loc=None,  # the graph never writes
            kv_cache=KVCache(k_caches, v_caches, self.page_size),
            attn_backend=self.ov_attn, attn_metadata=meta,
        )
        logits = self.ov_model(input_ids, positions, fb)
        return logits, torch.stack(meta.new_k + meta.new_v)

    def _decode_step_copy(self, bs: int):
        """`decode_step` on its own code object: dynamo keeps compiled graphs per code object,
        so each graph gets a cache of one entry (no walk over every graph's guards per step)."""
        return renamed_method(OpenVINORunner.decode_step, self, f"decode_step_bs{bs}")

    # Capture.
    def max_compiled_graphs(self) -> int:
        return len(self.buckets) + 1

    def capture(self) -> None:
        super().capture()
        # Start-up ends with every bucket's static graph at the traced width ready (compiled
        # beside the later buckets' traces): the first requests run at full speed. Wider KV
        # widths get theirs on first need.
        self.wait_static()
        trim_heap()
        if self.dynamic_kv and self.static_widths_at_start() == [self.trace_blocks]:
            logger.info("OpenVINO static decode graphs compiled for KV length %d; a batch past "
                        "it compiles the next width on first need (~4 s beside serving, "
                        "slower steps meanwhile): --openvino-static-kv-len compiles more at "
                        "start-up", self.trace_blocks * self.page_size)

    def static_widths_at_start(self) -> list[int]:
        """KV widths (block-table columns) whose requests and static graphs start-up makes for
        each bucket: the traced width and every width up to --openvino-static-kv-len tokens."""
        limit = self.config.openvino_static_kv_len
        return [self.trace_blocks] + [b for b in self.kv_blocks if b != self.trace_blocks
                                      and b * self.page_size <= limit]

    def capture_bucket(self, bs: int, fb: ForwardBatch) -> None:
        """Compile (and verify) the graph of `bs` rows, its block-table width symbolic, and
        bind its first request, at the width it was traced with."""
        compiler = OpenVINOCompiler(self.options, self.frozen)
        fn = torch.compile(self._decode_step_copy(bs), backend=compiler, fullgraph=True,
                           dynamic=False)
        table = fb.attn_metadata[:, :self.trace_blocks].contiguous()
        if self.dynamic_kv:
            torch._dynamo.mark_dynamic(table, 1)  # an error, not a silent specialization
        step = (fb.input_ids, fb.positions, fb.seq_lens, table)
        k, v = self.kv_cache.k_buffers, self.kv_cache.v_buffers
        start = time.perf_counter()
        out = compiler.first_run(fn, *step, k, v, device=self.ov_device)
        self.compile_seconds[bs] = time.perf_counter() - start
        compiler.bind([*step, *k, *v], out,
                      sizes={self.trace_blocks: "kv_blocks"} if self.dynamic_kv else None)
        self.compilers[bs] = compiler
        self._check_pool_reads(compiler)
        self._request(bs, self.trace_blocks, fb, table)
        for kv_blocks in self.static_widths_at_start()[1:]:
            self._request(bs, kv_blocks, fb)
        logger.info("OpenVINO decode graph bs=%d compiled in %.1fs (kv_len %s, %s, %s, "
                    "weights %s)", bs, self.compile_seconds[bs],
                    "dynamic" if self.dynamic_kv else self.trace_blocks * self.page_size,
                    self.ov_device, self.options["config"]["INFERENCE_PRECISION_HINT"],
                    self.weights_report())

    def _request(self, bs: int, kv_blocks: int, fb: ForwardBatch,
                 table: torch.Tensor | None = None) -> DecodeGraph:
        """An infer request of bucket `bs`'s graph over a block table `kv_blocks` wide; a
        request, not a compile: milliseconds."""
        if table is None:
            table = fb.attn_metadata[:, :kv_blocks].contiguous()
        k, v = self.kv_cache.k_buffers, self.kv_cache.v_buffers
        compiler = self.compilers[bs]
        size = {"kv_blocks": torch.tensor(kv_blocks, dtype=torch.int64)}  # a 0-d input
        inputs = [fb.input_ids, fb.positions, fb.seq_lens, table, *k, *v]
        graph = DecodeGraph(compiler, table, inputs, compiler.request(inputs, size))
        self.graphs[(bs, kv_blocks)] = graph
        if self.dynamic_kv:
            self.static_pending.append(
                self.static_pool.submit(self._specialize, graph, bs, kv_blocks))
        return graph

    def _specialize(self, graph: DecodeGraph, bs: int, kv_blocks: int) -> None:
        """Compile the pair's graph again with the width a constant, and switch the pair to it.

        OpenVINO runs the graph with a symbolic width ~20% slower a step than one compiled for
        a single width (default model, bs 1, W1 on a 2-core AMD EPYC: 49 against 59-64 tok/s,
        the static one reading 512 cached tokens every step). The dynamic request serves the
        pair at once; this compile (OpenVINO's alone, ~4 s, on a worker thread that shares the
        cores with serving meanwhile) replaces it. A failure keeps the dynamic request, logged
        and counted in `static_failures`: the pair still runs in OpenVINO, only slower."""
        start = time.perf_counter()
        try:
            static = graph.compiler.specialize(graph.inputs, {"kv_blocks": kv_blocks})
        except Exception as e:  # noqa: BLE001 - reported, and the dynamic request serves on
            self.static_failures += 1
            logger.warning("OpenVINO static graph bs=%d kv_len=%d failed to compile (%s: %s); "
                           "this pair keeps the graph with a dynamic KV width", bs,
                           kv_blocks * self.page_size, type(e).__name__, e)
            return
        graph.static = static  # replay reads graph.run once a step
        trim_heap()
        self.static_seconds[(bs, kv_blocks)] = time.perf_counter() - start
        logger.info("OpenVINO static graph bs=%d kv_len=%d compiled in %.1fs", bs,
                    kv_blocks * self.page_size, self.static_seconds[(bs, kv_blocks)])

    def wait_static(self) -> None:
        """Block until every static compile asked for so far has finished."""
        while self.static_pending:
            self.static_pending.pop(0).result()

    def _check_pool_reads(self, compiler: OpenVINOCompiler) -> None:
        """Warn (once) if OpenVINO touches the whole KV pool each step, not just gathers from
        it. Seen with a precision hint below the pool's dtype (bf16 over a float32 pool): the
        plugin converts the pool to that precision before the gather, every step. (bf16
        tensors cannot be graph inputs: the backend hands inputs over as numpy arrays.)"""
        readers = set(compiler.pool_input_consumers(self.model_runner.kv_pool.num_slots))
        if readers <= POOL_READERS or self.warned_pool_reads:
            return
        self.warned_pool_reads = True
        pool_mib = self.model_runner.kv_pool.memory_bytes() / 2**20
        logger.warning(
            "OpenVINO reads the whole KV pool (%.0f MiB) every decode step (%s before the "
            "gathers, precision hint %s): step time grows with --max-total-tokens. Use "
            "--openvino-precision f32, or --dtype float16 with --openvino-precision f16 "
            "(a float16 pool is read in place), or a small --max-total-tokens.", pool_mib,
            ", ".join(sorted(readers - POOL_READERS)),
            self.options["config"]["INFERENCE_PRECISION_HINT"])

    # Replay.
    def kv_blocks_for(self, max_seq_len: int) -> int:
        """The smallest KV bucket holding `max_seq_len - 1` cached tokens."""
        need = -(-max(max_seq_len - 1, 1) // self.page_size)
        return self.kv_blocks[bisect.bisect_left(self.kv_blocks, need)]

    def replay_bucket(self, bs: int, fb: ForwardBatch) -> torch.Tensor:
        kv_blocks = self.kv_blocks_for(max(fb.seq_lens_cpu))
        graph = self.graphs.get((bs, kv_blocks)) or self._request(bs, kv_blocks, fb)
        # fb.attn_metadata: the [bs, max_blocks] block table the replay hook filled.
        graph.table.copy_(fb.attn_metadata[:, :kv_blocks])
        # Straight to OpenVINO: no dynamo frame evaluation (guards over every weight and KV
        # buffer) and no per-call conversion of the ~64 inputs, ~4 ms a step on 2 cores. An
        # OpenVINO error raises here; nothing falls back.
        logits, new_kv = graph.run()
        self._write_kv(new_kv, fb.out_cache_loc)
        return logits

    def _write_kv(self, new_kv: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
        """new_kv: [2 * layers, bs, KVH, D], OpenVINO's buffer; copied into the cache here."""
        for i, buf in enumerate(self.kv_cache.k_buffers + self.kv_cache.v_buffers):
            buf.index_copy_(0, out_cache_loc, new_kv[i].to(buf.dtype))

    # Report.
    def weights_report(self) -> dict[str, int]:
        """Weight element types of the compiled matmuls, e.g. {"u4": 210, "i8": 1}: what
        OpenVINO really multiplies with (it would show "f32" had it decompressed the blocks)."""
        if not self.compilers:
            return {}
        return next(iter(self.compilers.values())).matmul_weight_types()

    def report(self) -> dict:
        report = super().report()
        report.update(
            openvino_device=self.ov_device,
            openvino_precision=self.options["config"]["INFERENCE_PRECISION_HINT"],
            openvino_weights=self.weights_report(),
            kv_len_buckets=[b * self.page_size for b in self.kv_blocks],
            kv_len_dynamic=self.dynamic_kv,
            compiled_graphs={str(bs): round(t, 3)
                             for bs, t in sorted(self.compile_seconds.items())},
            requests=[f"{bs}x{kv * self.page_size}" for bs, kv in sorted(self.graphs)],
            static_requests={f"{bs}x{kv * self.page_size}": round(t, 3)
                             for (bs, kv), t in sorted(self.static_seconds.items())},
            static_failures=self.static_failures,
            recompiles=sum(c.calls - 1 for c in self.compilers.values()),
        )
        return report
