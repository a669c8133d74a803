"""CPU decode graphs: `torch.compile`d (inductor) decode graphs shared by the buckets, replayed
without dynamo.

Default buckets are powers of two (1, 2, 4, ... up to `--torch-compile-max-bs`), not SGLang's
denser schedule; `--cuda-graph-bs` still picks any sizes. Buckets are compiled with the batch
dimension dynamic (`dynamic_batch`), so one inductor compile serves every bucket: packed GGUF
layers choose between their packed product (rows up to `--packed-decode-max-bs`) and their large
path when the graph runs (`airserve::packed_or_large`), not by a guard on the size. bs 1 shares
the graph too (`share_bs1`: compiled with `backed_size_oblivious`, a symbolic size may be 1;
dynamo otherwise guards every dynamic size >= 2 and compiles bs 1 as a static graph of its own).
A compile is mostly inductor's lowering and the C++ build of its ~11 distinct kernels (two
parallel compile workers); with the default buckets on a 2-core AMD EPYC one compile instead of
two roughly halves the cold start. A new graph is compiled only when dynamo's guards (a size
branch in the model) ask for it; the report says how many (`graphs_compiled`). With
`--compile-cache-dir` every compiled graph is stored once (bucket_store.py) and a restart with
the same model and flags loads it without dynamo or inductor's compile; a stale stored bucket is
logged, counted in the report (`stale_buckets`) and compiled again.

Replay calls each bucket's compiled graph directly with the tensors (and the batch size) it was
called with for that bucket (the model's weights, the KV buffers and the bucket's static batch,
all at fixed addresses), so no dynamo frame runs per step: no guard evaluation, no cache
lookup, no input flattening (~1-2 ms a step on 2 cores). A loaded bucket replays directly from
the start. The first replay of a compiled bucket still goes through dynamo and checks that
dynamo hands the graph those tensors (or views of the same memory, which the capture-time
tensors keep alive); a bucket that fails the check keeps replaying through dynamo (guards
skipped), logged and counted in the report (`dynamo_replays`).

No recompiles after capture: every bucket is compiled (or its shared graph found) at capture,
the KV buffers are marked static, and dynamo's recompile limit is raised to fit the buckets
(the limit is shared by every wrapper of the model's `forward`; past it dynamo silently runs
eager).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from airserve.srt.forward_batch import ForwardBatch
from airserve.srt.model_executor.graph_runners.base import (
    GraphRunner,
    configure_compile_cache,
    dynamo_graph_count,
    power_of_two_buckets,
)
from airserve.srt.model_executor.graph_runners.bucket_store import (
    BucketStore,
    StaleBucket,
    TensorIndex,
    cache_key_parts,
)
from airserve.srt.model_executor.graph_runners.config import RunnerConfig

logger = logging.getLogger(__name__)


class CompiledGraph:
    """A bucket's compiled graph, as the backend returned it to dynamo; records the inputs and
    outputs of the last call that went through dynamo."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.symbolic = False  # traced with a symbolic batch size
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


# Inductor options of every decode graph. Replay hands a graph the tensors it was compiled on
# (or, loaded from the store, views rebuilt with the stored shapes and strides), so the generated
# wrapper's per-step layout checks of its inputs and of the custom ops' outputs (~640 Python
# calls a step for the default model) check nothing replay could change. The wrapper is C++
# (`cpp_wrapper`: the custom ops are called through the dispatcher, no Python per op; quiet, 2
# threads, a bs-1 step of the default model 11.0 vs 12.7 ms, its compile ~95 vs ~66 s), built
# apart from the kernels at a low optimization level (`cpp_wrapper_build_separate`: built with
# them at -O3, the wrapper more than doubled the compile time).
INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False,
                    "cpp_wrapper": True, "cpp_wrapper_build_separate": True}
# The wrapper's optimization level (AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL, where set, decides),
# a trade of compile time against step time. At -O0 g++ built the default model's decode wrapper
# in 3.2 s against 13.1 s at -O1 (~10 s off every cold start; 2-core AMD EPYC Zen 3, AVX2), but
# the step lost its inlined calls: bs-1 decode in bench_one_batch, four rounds alternated, 13.54
# / 13.28 / 12.14 / 13.18 ms at -O0 against 12.74 / 12.16 / 12.16 / 12.83 ms at -O1 (~6% of
# every token, for 10 s once). So -O1, inductor's own default, named here.
WRAPPER_OPT_LEVEL = "O1"


# Inductor compiles in parallel in a pool of worker processes, each of which imports torch, and
# the pool lives on while the server serves. On few cores it buys no time and costs memory: a
# cold start of the default model's buckets without a compile store on a 2-core AMD EPYC peaked
# at 2745 MiB over the process tree with a pool of two (7 processes) and 1924 MiB without (4),
# ready in 63.9 against 57.3 s (benchmark/runners/startup.py --no-store --compile-threads
# airserve 2). Up to this many cores inductor compiles in the runner's process;
# TORCHINDUCTOR_COMPILE_THREADS, where set, decides.
SERIAL_COMPILE_MAX_CORES = 4


def compile_threads(cpu_count: int | None, environ=os.environ) -> int | None:
    """Inductor's compile_threads for a machine of `cpu_count` cores: 1 up to
    SERIAL_COMPILE_MAX_CORES, else None (inductor's own choice, as where the variable is set)."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in environ or cpu_count is None:
        return None
    return 1 if cpu_count <= SERIAL_COMPILE_MAX_CORES else None


def inductor_options(tp_size: int) -> dict:
    """INDUCTOR_OPTIONS for a runner of a `tp_size`-rank group, with `compile_threads` and the
    wrapper's optimization level where they apply. With tensor parallelism the wrapper stays
    Python: the C++ wrapper cannot call torch's functional collectives on CPU (inductor: "arg
    type Any is not yet supported by custom_op_wrapper")."""
    options = dict(INDUCTOR_OPTIONS)
    if "AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL" not in os.environ:
        options["aot_inductor.compile_wrapper_opt_level"] = WRAPPER_OPT_LEVEL
    if tp_size > 1:
        options.update(cpp_wrapper=False, cpp_wrapper_build_separate=False)
    threads = compile_threads(os.cpu_count())
    if threads is not None:
        options["compile_threads"] = threads
    return options


# The static batch's tensors with a batch dimension (besides the attention metadata).
BATCH_FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")


def mark_batch_dynamic(fb: ForwardBatch) -> None:
    """Ask dynamo to compile `fb`'s decode step for any batch size (dimension 0 symbolic)."""
    tensors = [getattr(fb, name) for name in BATCH_FIELDS] + [fb.attn_metadata]
    for t in tensors:
        if isinstance(t, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(t, 0)


def batch_size_oblivious(enabled: bool):
    """While compiling: a symbolic batch size may be 1. Without it dynamo assumes a dynamic size
    is at least 2, guards the graph on that and compiles bs 1 again as its own static graph (the
    slowest of the cold start's compiles); with it bs 1 takes the shared graph of its code path
    when that graph's guards (the model's own size branches) hold for 1."""
    import contextlib

    import torch.fx.experimental._config as shape_config

    if not enabled:
        return contextlib.nullcontext()
    return shape_config.patch(backed_size_oblivious=True)


def has_symbolic_inputs(gm: torch.fx.GraphModule) -> bool:
    """dynamo traced `gm` with a symbolic size among its inputs."""
    return any(isinstance(n.meta.get("example_value"), torch.SymInt)
               for n in gm.graph.nodes if n.op == "placeholder")


class CPUGraphRunner(GraphRunner):
    compile_runner = True
    schedule = staticmethod(power_of_two_buckets)
    # Buckets above 1 share compiled graphs (batch dimension dynamic); False compiles one graph
    # per bucket with static shapes (benchmark/runners/replay_overhead.py compares the two).
    dynamic_batch = True
    # With dynamic_batch: bs 1 may share the graph of the buckets on its code path instead of a
    # static graph of its own (batch_size_oblivious); False gives bs 1 its own static graph.
    share_bs1 = True

    def __init__(self, model_runner) -> None:
        configure_compile_cache(model_runner.runner_config.compile_cache_dir)
        self.step: Callable[[ForwardBatch], torch.Tensor] | None = None  # torch.compile'd
        self.step_graphs: list[CompiledGraph] = []  # every graph dynamo compiled, in order
        self.compiled: dict[int, Callable[[ForwardBatch], torch.Tensor]] = {}
        self.graphs: dict[int, CompiledGraph] = {}
        self.capture_args: dict[int, tuple] = {}
        self.direct: dict[int, Callable[[], torch.Tensor]] = {}
        self.direct_refused: dict[int, str] = {}
        self.dynamo_replays = 0
        self.graphs_at_capture = 0
        # Buckets stored under --compile-cache-dir: loaded at start-up instead of compiled.
        self.store = self.open_store(model_runner.runner_config,
                                     getattr(model_runner.tp, "rank", 0),
                                     model_runner.max_running_requests, self.dynamic_batch)
        self.loaded: dict[int, float] = {}  # bucket -> seconds to load it
        self.artifacts: dict[str, Callable] = {}  # stored graphs loaded, by file name
        self.stored: dict[int, str] = {}  # id(compiled graph) -> its stored file name
        self.stale: dict[int, str] = {}  # bucket -> why its stored graph was not used
        self.unstored: dict[int, str] = {}  # bucket -> why its compiled graph was not stored
        self.inductor_options = inductor_options(model_runner.tp.size)
        for buf in model_runner.kv_cache.k_buffers + model_runner.kv_cache.v_buffers:
            torch._dynamo.mark_static_address(buf)
        super().__init__(model_runner)

    @staticmethod
    def open_store(config: RunnerConfig, tp_rank: int, max_running_requests: int,
                   dynamic_batch: bool = True) -> BucketStore | None:
        """The stored buckets of this model and these flags (None without a cache dir)."""
        if config.compile_cache_dir is None or config.compile_backend != "inductor":
            return None
        extra = {"tp_rank": tp_rank, "max_running_requests": max_running_requests,
                 "dynamic_batch": dynamic_batch}
        return BucketStore(config.compile_cache_dir,
                           cache_key_parts(config.resolved_model_path, config.graph_flags, extra))

    def tensor_index(self) -> TensorIndex:
        """Every tensor a decode graph may take as input, by a name stable across processes."""
        return TensorIndex({"model": self.model, "kv": self.kv_cache, "inputs": self.inputs,
                            "attn": self.attn_backend,
                            "req_to_token": self.model_runner.req_to_token_pool})

    def capture(self) -> None:
        super().capture()
        # Inductor compiles kernels in a pool of worker processes (torch._inductor.config.
        # compile_threads, one per core) that each import torch and stay for the life of the
        # process. The buckets are compiled: free them (a later compile starts a new pool).
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()

    def capture_bucket(self, bs: int, fb: ForwardBatch) -> None:
        if self.store is not None and self.store.has(bs) and self.load_bucket(bs):
            return
        self.compile_bucket(bs, fb)

    def load_bucket(self, bs: int) -> bool:
        """Replay bucket `bs` from its stored graph; False (logged, counted) if it is stale."""
        import torch._inductor.config as inductor_config

        start = time.perf_counter()
        try:
            # Under the options it was compiled with: inductor keys the wrapper's shared library
            # by them (the wrapper's optimization level among them), and a load under other
            # options built the wrapper again (~20 s of a warm start) instead of finding it.
            with inductor_config.patch(self.inductor_options):
                artifact, args = self.store.load(bs, self.tensor_index(), self.artifacts)
                # One step on the static batch, as a compile runs one. AOTAutograd's first-call
                # check of custom ops' aliasing ran on this graph's first call after it was
                # compiled (same ops, same graph); here it would trace every op through a
                # dispatch mode.
                with torch._functorch.config.patch(check_custom_op_aliasing=False):
                    outs = artifact(*args)
            if not isinstance(outs, (list, tuple)) or len(outs) != 1 or \
                    tuple(outs[0].shape[:1]) != (bs,):
                raise StaleBucket("the stored graph does not return the logits [bs, vocab]")
        except Exception as e:  # whatever a stored graph does wrong, compiling it again fixes
            self.stale[bs] = str(e) if isinstance(e, StaleBucket) else f"{type(e).__name__}: {e}"
            logger.warning("CPUGraphRunner: stored bucket %d is stale, recompiling: %s", bs, e)
            return False
        self.direct[bs] = lambda: artifact(*args)[0]
        self.loaded[bs] = time.perf_counter() - start
        logger.info("CPUGraphRunner: bucket %d loaded from %s in %.2fs", bs, self.store.dir,
                    self.loaded[bs])
        return True

    def compile_step(self) -> Callable[[ForwardBatch], torch.Tensor]:
        """The decode step under torch.compile; every graph dynamo makes of it is recorded in
        `step_graphs` (compiled by inductor, or, when storing, compiled after its first call)."""
        import torch._inductor.config as inductor_config

        backend = torch._dynamo.lookup_backend(self.backend_name)

        def recording_backend(gm, example_inputs):
            # Storing: dynamo's graph runs eager once, then is compiled on the real inputs.
            if self.store is not None:
                graph = CompiledGraph(gm)
            else:
                with inductor_config.patch(self.inductor_options):
                    graph = CompiledGraph(backend(gm, example_inputs))
            graph.symbolic = has_symbolic_inputs(gm)
            self.step_graphs.append(graph)
            return graph

        # dynamic=False: no automatic dynamic shapes (its per-code-object history is shared with
        # every other runner of this process); only the batch dimension marked at capture is.
        return torch.compile(self.forward_static, backend=recording_backend, fullgraph=True,
                             dynamic=False)

    def compile_bucket(self, bs: int, fb: ForwardBatch) -> None:
        """Run bucket `bs` through dynamo: it compiles a graph for it or picks a shared one."""
        start = time.perf_counter()
        if self.step is None:
            self.step = self.compile_step()
        if self.dynamic_batch and (bs > 1 or self.share_bs1):
            mark_batch_dynamic(fb)
        known = len(self.step_graphs)
        for graph in self.step_graphs:
            graph.outputs = None
        with batch_size_oblivious(self.dynamic_batch and self.share_bs1):
            self.step(fb)  # the dummy-slot writes of the all-padding batch are harmless
        called = [g for g in self.step_graphs if g.outputs is not None]
        if len(self.step_graphs) - known > 1 or len(called) != 1:
            raise RuntimeError(f"expected one compiled graph to run the decode step, dynamo "
                               f"made {len(self.step_graphs) - known} and called {len(called)}")
        graph = called[0]
        new = len(self.step_graphs) > known
        if new and self.store is not None:
            self.compile_storable(graph, self.inductor_options)
        self.compiled[bs] = self.step
        self.graphs[bs] = graph
        self.capture_args[bs] = graph.args
        self.graphs_at_capture = dynamo_graph_count()
        compiled_s = time.perf_counter() - start
        if self.store is not None:
            self.store_bucket(bs, graph)
        logger.info("CPUGraphRunner: bucket %d %s in %.2fs%s", bs,
                    "compiled" if new else f"shares graph {self.step_graphs.index(graph)}",
                    compiled_s, "" if self.store is None or bs in self.unstored else ", stored")

    @staticmethod
    def compile_storable(graph: CompiledGraph, options: dict) -> None:
        """Compile dynamo's graph with inductor into an artifact that can be saved; dynamo's
        entry for the graph calls it from now on (the recorder is what dynamo holds)."""
        import torch._inductor.config as inductor_config
        from torch._inductor import standalone_compile

        # A graph with a symbolic batch size keeps dynamo's shape environment; a static one is
        # compiled for the sizes it was called with.
        shapes = "from_graph" if graph.symbolic else "from_example_inputs"
        with inductor_config.patch(options):
            graph.fn = standalone_compile(graph.fn, list(graph.args), dynamic_shapes=shapes,
                                          options={})

    def store_bucket(self, bs: int, graph: CompiledGraph) -> None:
        try:
            name = self.stored.get(id(graph))
            if name is None:
                name = self.stored[id(graph)] = self.store.save_artifact(graph.fn)
            self.store.save(bs, name, graph.args, self.tensor_index())
        except (KeyError, RuntimeError, OSError) as e:
            self.unstored[bs] = f"{type(e).__name__}: {e}"
            logger.warning("CPUGraphRunner: bucket %d not stored (compiled again at the next "
                           "start): %s", bs, self.unstored[bs])

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
        report["buckets_loaded"] = sorted(self.loaded)
        report["buckets_compiled"] = sorted(self.graphs)
        report["graphs_compiled"] = len(self.step_graphs)
        report["graphs_loaded"] = len(self.artifacts)
        report["cpp_wrapper"] = bool(self.inductor_options["cpp_wrapper"])
        report["compile_threads"] = self.inductor_options.get("compile_threads", "inductor's")
        if self.stale:
            report["stale_buckets"] = dict(self.stale)
        if self.unstored:
            report["unstored_buckets"] = dict(self.unstored)
        if self.direct_refused:
            report["direct_replay_refused"] = dict(self.direct_refused)
        return report
