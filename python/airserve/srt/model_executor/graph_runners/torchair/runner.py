"""Ascend decode graphs through torchair: one `torch.compile`d decode step per batch size.

Selected by `--device npu --enable-torch-compile`. A graph runner like every other (the same
base, the same two hooks, the same replay); what is its own is the compiler, which comes from
one seam, `get_compile_backend` (torchair's NPU backend on --device npu); tests pass inductor
or a recording backend to the constructor, and nothing else differs between CPU and NPU.

Every bucket is one graph, compiled once, whatever the live lengths. torchair documents the
recipe for graphs holding FIA (docs "模型中存在FA算子，如何执行整图静态下沉调度", path 4):
`dynamic=True` with every tensor input marked static, so tensor shapes are constants while the
ints of FIA's host list `actual_seq_lengths_kv` stay symbols, i.e. graph inputs. With
`dynamic=False` those ints are baked in and each new length recompiles (its path 1). In
ACL-graph mode the same symbols are rewritten on each replay without recapture: torchair's
`_acl_concrete_graph/acl_graph.py` lists them as FIA's "updated_param_keys". A compile hook
checks each graph: a tensor input with a symbolic dimension is a capture error.

Inputs of the step (bucket bs): input_ids, positions, out_cache_loc [bs] int64; seq_lens [bs]
int32 and its host list; the block table [bs, ceil(context_len / page_size)] int32 padded to
full width; every layer's K and V cache [num_slots, kv_heads, head_dim] (static address, never
copied). Each bucket compiles its own renamed copy of `DecodeStep.forward` (`renamed_method`):
separate code objects keep dynamo's per-code caches and torchair's per-method compile caches
apart.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import TYPE_CHECKING

import torch
from torch import nn

from airserve.srt import forward_batch
from airserve.srt.forward_batch import ForwardBatch, ForwardMode, KVCache
from airserve.srt.model_executor.graph_runners.base import (
    GraphCaptureError,
    GraphRunner,
    dynamo_graph_count,
    renamed_method,
)
from airserve.srt.model_executor.graph_runners.torchair.cache import (
    UNKNOWN,
    CompileCacheKey,
    cann_version,
    model_config_hash,
    open_bucket_cache,
    source_hash,
    torch_npu_version,
)
from airserve.srt.model_executor.graph_runners.torchair.compile import (
    CompileBackend,
    as_compile_backend,
    get_compile_backend,
)

if TYPE_CHECKING:
    from airserve.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class DecodeStep(nn.Module):
    """The decode step a bucket compiles: explicit inputs in, logits [bs, vocab] out."""

    def __init__(self, model: nn.Module, attn_backend, page_size: int) -> None:
        super().__init__()
        self.model = model
        self.attn_backend = attn_backend
        self.page_size = page_size

    def forward(self, input_ids, positions, out_cache_loc, seq_lens, seq_lens_host, block_table,
                k_buffers, v_buffers):
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=input_ids.shape[0], input_ids=input_ids,
            positions=positions, req_pool_indices=None, seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_host, out_cache_loc=out_cache_loc,
            kv_cache=KVCache(k_buffers, v_buffers, self.page_size),
            attn_backend=self.attn_backend, attn_metadata=block_table,
        )
        return self.model(input_ids, positions, fb)

    def method_for(self, bs: int):
        """`forward` under the name decode_bs{bs}, on its own code object, bound to self."""
        return renamed_method(DecodeStep.forward, self, f"decode_bs{bs}")


class TorchAirRunner(GraphRunner):
    """Compiled decode steps, one per bucket, on the graph-runner contract."""

    compile_runner = True
    outputs_reused = True  # compiled outputs may live in memory the next replay overwrites
    bucket_kind = "compiled"
    capture_hint = ("Try a smaller --torch-compile-max-bs, fewer sizes with --cuda-graph-bs, "
                    "another --torchair-mode, or drop --enable-torch-compile (NPU graph "
                    "runner).")
    CAPTURE_RUNS = 2  # the second changes the host lengths: a specialised graph fails here

    def __init__(self, model_runner: ModelRunner,
                 compile_backend: CompileBackend | str | None = None) -> None:
        self.given_backend = (None if compile_backend is None
                              else as_compile_backend(compile_backend))
        kv_cache = model_runner.kv_cache
        self.step = DecodeStep(model_runner.model, model_runner.attn_backend, kv_cache.page_size)
        self.compiled: dict[int, object] = {}
        self.graphs: Counter[int] = Counter()  # graphs compiled per bucket
        self._compile_ids: set[tuple] = set()
        self.graphs_at_capture = 0
        self.symbolic_inputs: dict[int, int] = {}  # symbolic-int graph inputs per bucket
        self.recompiles = 0
        for buf in kv_cache.k_buffers + kv_cache.v_buffers:
            _mark_static(buf)
        super().__init__(model_runner)

    @functools.cached_property
    def compile_backend(self) -> CompileBackend:
        """The given backend, else torchair's on npu (inductor elsewhere); needs the buckets."""
        if self.given_backend is not None:
            return self.given_backend
        return get_compile_backend(self.config, len(self.buckets))

    @property
    def backend_name(self) -> str:
        backend = self.__dict__.get("compile_backend", self.given_backend)
        return backend.name if backend is not None else "torchair"

    @functools.cached_property
    def cache_root(self) -> str | None:
        root = self.config.torchair_cache_dir
        if root and self.compile_backend.cache_compile is None:
            logger.warning("--torchair-cache-dir ignored: the %s backend has no compile cache",
                           self.backend_name)
            return None
        return root

    def _inputs(self, fb: ForwardBatch) -> tuple:
        return (fb.input_ids, fb.positions, fb.out_cache_loc, fb.seq_lens, fb.seq_lens_cpu,
                fb.attn_metadata, self.kv_cache.k_buffers, self.kv_cache.v_buffers)

    # Capture.
    def capture_bucket(self, bs: int, fb: ForwardBatch) -> None:
        graphs = self.graph_count()
        for t in (fb.input_ids, fb.positions, fb.seq_lens, fb.out_cache_loc, fb.attn_metadata):
            _mark_static(t)
        self.compiled[bs] = self._compile(bs)
        # Floats in the model (eps, scale) are constants: traced as symbols they are
        # specialised later, which restarts dynamo's analysis (tracing twice).
        with torch._dynamo.config.patch(specialize_float=True):
            for run in range(self.CAPTURE_RUNS):
                self._set_padding_lens(fb, bs, 1 + run)
                self.compiled[bs](*self._inputs(fb))
        self._set_padding_lens(fb, bs, 1)
        if self.graph_count() - graphs > 1:
            raise GraphCaptureError(
                f"TorchAirRunner recompiled batch size {bs} when only the sequence lengths "
                f"changed ({self.graph_count() - graphs} graphs): an input is not static")
        self.graphs_at_capture = self.graph_count()

    def graph_count(self) -> int:
        """Graphs compiled so far. Through torchair's cache_compile the compile hook is
        torchair's own, so count dynamo's graphs (a graph loaded from the cache is none)."""
        return dynamo_graph_count() if self.cache_root else sum(self.graphs.values())

    def _set_padding_lens(self, fb: ForwardBatch, bs: int, length: int) -> None:
        fb.seq_lens.fill_(length)  # the static batch's view [:bs]
        fb.seq_lens_cpu = [length] * bs

    def _compile(self, bs: int):
        method = self.step.method_for(bs)
        if self.cache_root:
            folder = open_bucket_cache(self.cache_root, self.cache_key(bs))
            return self.compile_backend.cache_compile(method, folder)
        return torch.compile(method, backend=self._graph_hook(bs), fullgraph=True, dynamic=True)

    def _graph_hook(self, bs: int):
        backend = self.compile_backend.backend
        if isinstance(backend, str):
            backend = torch._dynamo.lookup_backend(backend)

        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            # A restarted analysis calls the backend again for the same graph: count compile
            # ids (frame, compile of that frame), not calls.
            cid = torch._guards.CompileContext.current_compile_id()
            key = (bs, cid.frame_id, cid.frame_compile_id) if cid else (bs, len(self._compile_ids))
            if key not in self._compile_ids:
                self._compile_ids.add(key)
                self.graphs[bs] += 1
            self.symbolic_inputs[bs] = check_static_tensor_inputs(gm, bs)
            return backend(gm, example_inputs)

        return compile_graph

    def cache_key(self, bs: int) -> CompileCacheKey:
        mr, buf = self.model_runner, self.kv_cache.k_buffers[0]
        key = CompileCacheKey(
            bucket=bs, kv_shape=tuple(buf.shape), kv_dtype=str(buf.dtype),
            num_layers=len(self.kv_cache.k_buffers), page_size=self.kv_cache.page_size,
            max_blocks=self.attn_backend.max_blocks,
            model_path=self.config.model_path,
            model_config_hash=model_config_hash(mr.model_config),
            code_hash=source_hash(type(mr.model), type(self.attn_backend), DecodeStep,
                                  forward_batch),
            mode=self.compile_backend.mode,
            compiler_options=repr(sorted(self.compile_backend.options.items())),
            torch=torch.__version__, torch_npu=torch_npu_version(), cann=cann_version())
        if mr.device == "npu" and key.cann == UNKNOWN:
            raise GraphCaptureError(
                "--torchair-cache-dir needs the CANN version to keep stale graphs out, and it is "
                "unknown: source CANN's set_env.sh (it sets ASCEND_TOOLKIT_HOME), or drop "
                "--torchair-cache-dir")
        return key

    # Replay.
    def replay_bucket(self, bs: int, fb: ForwardBatch) -> torch.Tensor:
        logits = self.compiled[bs](*self._inputs(fb))
        graphs = self.graph_count()
        if graphs != self.graphs_at_capture + self.recompiles:
            logger.error("TorchAirRunner recompiled the decode step at batch size %d after "
                         "capture (%d graphs for %d buckets): an input is not static", bs,
                         graphs, len(self.buckets))
            self.recompiles = graphs - self.graphs_at_capture
        return logits

    # Report.
    def memory_in_use(self) -> int:
        if self.model_runner.device == "npu":
            torch.npu.synchronize()
            free, total = torch.npu.mem_get_info()
            return total - free
        return super().memory_in_use()

    def report(self) -> dict:
        return {
            **super().report(),
            "graphs_per_bucket": dict(sorted(self.graphs.items())),
            "symbolic_inputs_per_bucket": dict(sorted(self.symbolic_inputs.items())),
            "recompiles_since_capture": self.recompiles,
            "compile_cache": self.cache_root,
        }

    def log_report(self) -> None:
        super().log_report()
        logger.info("torchair compile cache: %s", self.cache_root or "off")


def _mark_static(t: torch.Tensor) -> None:
    """Fixed shape (no symbolic dims, no recompiles) and fixed address (graph backends use the
    tensor in place instead of copying it into graph memory each replay). A view's base too:
    dynamo traces the base of a view input, and would make its size a symbol."""
    for x in (t, t._base) if t._base is not None else (t,):
        torch._dynamo.mark_static(x)
        torch._dynamo.mark_static_address(x)


def check_static_tensor_inputs(gm: torch.fx.GraphModule, bs: int) -> int:
    """Raise if a tensor input of the graph has a symbolic dimension; return how many inputs
    are symbolic ints (the host seq lengths, when the attention backend reads them)."""
    symbolic = 0
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.SymInt):
            symbolic += 1
        elif isinstance(value, torch.Tensor) and any(
                isinstance(d, torch.SymInt) for d in value.shape):
            raise GraphCaptureError(
                f"decode graph input {node.name} of batch size {bs} has symbolic shape "
                f"{tuple(value.shape)}: it would make the graph dynamic; mark it static")
    return symbolic
