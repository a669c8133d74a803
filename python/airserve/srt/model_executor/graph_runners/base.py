"""The decode graph-runner contract: capture the decode step once per batch size, then replay.

A runner says only how to capture one bucket (`capture_bucket`) and how to run it
(`replay_bucket`). Everything else lives here, once for every runner: the bucket schedule,
the capture loop and its one error, replay with output slicing, the fallback rules, the
start-up report; the static inputs and their inert padded rows are a `StaticDecodeInputs`.
Runners that torch.compile their buckets share the helpers below (compile cache, dynamo's
recompile limit and graph count, one renamed decode method per bucket).
"""

from __future__ import annotations

import logging
import os
import time
import types
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from airserve.srt.forward_batch import ForwardBatch
from airserve.srt.model_executor.graph_runners.config import RunnerConfig
from airserve.srt.model_executor.graph_runners.static_inputs import StaticDecodeInputs

if TYPE_CHECKING:
    from airserve.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def trim_heap() -> bool:
    """Return the heap pages freed by a compile to the OS (glibc's `malloc_trim`); False where
    the C library has none. Compiles free most of what they allocate, but glibc keeps the pages
    in the process: after the OpenVINO runner compiled the default model's decode graph at two
    KV widths, the process held 4292 MiB, 1976 MiB after a trim (2-core AMD EPYC)."""
    import ctypes

    process = ctypes.CDLL(None)  # the symbols already loaded, the C library's among them
    if not hasattr(process, "malloc_trim"):
        return False
    process.malloc_trim(0)
    return True

# Largest captured batch when --cuda-graph-max-bs is unset (capped by --max-running-requests).
DEFAULT_CUDA_GRAPH_MAX_BS = 256


def default_buckets(max_bs: int) -> list[int]:
    """SGLang's schedule: 1, 2, 4, 8, 12, then every 8 from 16; `max_bs` itself always."""
    sizes = [1, 2, 4, 8, 12] + list(range(16, max_bs + 1, 8))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


def power_of_two_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, ... and `max_bs`: for runners whose every bucket is a slow compile."""
    sizes = [1 << i for i in range(max_bs.bit_length()) if 1 << i <= max_bs]
    return sorted(set(sizes) | {max_bs})


def get_batch_size_buckets(config: RunnerConfig, max_running_requests: int,
                           compile_runner: bool = False,
                           schedule: Callable[[int], list[int]] = default_buckets) -> list[int]:
    """Sorted batch sizes to capture.

    `--cuda-graph-bs` overrides the schedule; otherwise `schedule` up to `--cuda-graph-max-bs`
    (`--torch-compile-max-bs` for runners that compile every bucket).
    Never above `max_running_requests`: no batch can be larger.
    """
    if config.cuda_graph_bs:
        sizes = [s for s in config.cuda_graph_bs if s <= max_running_requests]
        dropped = sorted(set(config.cuda_graph_bs) - set(sizes))
        if dropped:
            logger.warning("--cuda-graph-bs %s exceed --max-running-requests %d: not captured",
                           dropped, max_running_requests)
        return sizes or [max_running_requests]
    if compile_runner:
        max_bs = config.torch_compile_max_bs
    else:
        max_bs = config.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS
    return schedule(min(max_bs, max_running_requests))


class GraphCaptureError(RuntimeError):
    pass


# Helpers for runners that torch.compile their buckets.
def configure_compile_cache(cache_dir: str | None) -> None:
    """Point inductor's on-disk caches (FX graphs, compiled C++) at `cache_dir`.

    Must run before the first compile: inductor reads the directory once. Restarts with the
    same directory skip code generation and the C++ compiler.
    """
    if cache_dir is None:
        return
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
    os.makedirs(cache_dir, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True


def live_graph_entries(fn: Callable) -> int:
    """Compiled entries dynamo still holds for `fn`'s code, after collecting dead runners (their
    entries count against the recompile limit until their guarded objects are freed)."""
    import gc

    from torch._dynamo import eval_frame

    gc.collect()
    code = getattr(fn, "__code__", None)
    if code is None or not hasattr(eval_frame, "_debug_get_cache_entry_list"):
        return 0
    return len(eval_frame._debug_get_cache_entry_list(code))


def raise_recompile_limit(num_graphs: int) -> None:
    """Let dynamo keep `num_graphs` compiled entries of one function (default 8)."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), num_graphs))
    limit = dynamo_config.accumulated_recompile_limit
    dynamo_config.accumulated_recompile_limit = max(limit, 4 * num_graphs)


def dynamo_graph_count() -> int:
    """Graphs dynamo has compiled in this process: it grows on every (re)compile."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def renamed_method(fn: Callable, owner: object, name: str) -> Callable:
    """`fn` on its own code object named `name`, bound to `owner`.

    dynamo keeps its compiled entries per code object, and torchair's compile cache keys by
    the method's name: a copy per bucket keeps each bucket's graph apart from the others.
    """
    qualname = f"{type(owner).__name__}.{name}"
    code = fn.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=qualname)
    func = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    func.__qualname__ = qualname
    return types.MethodType(func, owner)


class GraphRunner(ABC):
    """Captured decode steps, one per bucket; `replay(fb)` returns logits [fb.batch_size, vocab].

    Each bucket runs on the static batch `self.inputs.batches[bs]`; padded rows are inert (see
    StaticDecodeInputs). Built from the model runner's model, attention backend and KV cache
    and its `RunnerConfig`; never from `ServerArgs`.
    """

    compile_runner = False  # buckets go up to --torch-compile-max-bs, not --cuda-graph-max-bs
    schedule = staticmethod(default_buckets)  # default bucket sizes up to a max
    outputs_reused = False  # the captured output buffer is overwritten by the next replay
    bucket_kind = "captured"  # how buckets are made, for fallback reasons
    # What to try when a bucket fails to capture (part of GraphCaptureError's message).
    capture_hint = ("Try a smaller --cuda-graph-max-bs (--torch-compile-max-bs for compiled "
                    "runners), fewer sizes with --cuda-graph-bs, --disable-cuda-graph, or drop "
                    "--enable-torch-compile.")

    def __init__(self, model_runner: ModelRunner) -> None:
        self.model_runner = model_runner
        self.config = config = model_runner.runner_config
        self.model = model_runner.model
        self.attn_backend = model_runner.attn_backend
        self.kv_cache = model_runner.kv_cache
        self.inputs = StaticDecodeInputs(
            get_batch_size_buckets(config, model_runner.max_running_requests,
                                   self.compile_runner, self.schedule),
            config.padding, model_runner.device, self.kv_cache, self.attn_backend,
            kind=self.bucket_kind)
        self.buckets = self.inputs.buckets
        self.input_ids = self.inputs.input_ids  # [max_bs]: what every bucket's tokens view
        self.capture_seconds: dict[int, float] = {}
        self.memory_bytes = 0
        self.replay_count = 0
        self.capture()

    @property
    def backend_name(self) -> str:
        """The compile backend, for the report ("none" when nothing is compiled)."""
        return self.config.backend_name

    @property
    def padding(self) -> bool:
        return self.inputs.padding

    @padding.setter
    def padding(self, value: bool) -> None:
        self.inputs.padding = value

    # Capture.
    def max_compiled_graphs(self) -> int:
        """How many graphs dynamo must be allowed to keep per function: one per bucket (+1)."""
        return len(self.buckets) + 1

    @abstractmethod
    def capture_bucket(self, bs: int, fb: ForwardBatch) -> None:
        """Capture (or compile) the decode step for the static batch `fb` of `bs` rows."""

    @abstractmethod
    def replay_bucket(self, bs: int, fb: ForwardBatch) -> torch.Tensor:
        """Run bucket `bs` on the current contents of the static inputs: logits [bs, vocab]."""

    def memory_in_use(self) -> int:
        """Bytes in use on the device, for the capture report (host RSS on CPU)."""
        import psutil

        return psutil.Process().memory_info().rss

    def forward_static(self, fb: ForwardBatch) -> torch.Tensor:
        """The eager decode step over a static batch: what subclasses capture or compile."""
        return self.model(fb.input_ids, fb.positions, fb)

    @torch.inference_mode()
    def capture(self) -> None:
        # Past dynamo's recompile limit a compiled function silently runs eager.
        # Other runners of this process (tests, TP ranks' siblings) may still hold entries of the
        # same code object; they count against the per-function limit.
        raise_recompile_limit(self.max_compiled_graphs()
                              + live_graph_entries(type(self).forward_static))
        before = self.memory_in_use()
        # Largest first: later graphs reuse its memory. One console bar step per bucket.
        bar = tqdm(list(reversed(self.buckets)), desc=f"{type(self).__name__} capture",
                   unit="bucket", leave=True)
        for bs in bar:
            bar.set_postfix_str(f"bs={bs}")
            fb = self.inputs.batches[bs]
            self.attn_backend.init_forward_metadata_capture(fb, bs)
            start = time.perf_counter()
            try:
                self.capture_bucket(bs, fb)
            except Exception as e:
                raise GraphCaptureError(
                    f"{type(self).__name__} ({self.backend_name}) failed to capture the decode "
                    f"step at batch size {bs} ({type(e).__name__}: {e}). {self.capture_hint}"
                ) from e
            self.capture_seconds[bs] = time.perf_counter() - start
        bar.close()
        trim_heap()
        self.memory_bytes = max(0, self.memory_in_use() - before)
        self.log_report()

    # Replay.
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        n = fb.batch_size
        static = self.inputs.load(fb)
        logits = self.replay_bucket(static.batch_size, static)
        self.replay_count += 1
        return logits[:n].clone() if self.outputs_reused else logits[:n]

    # Batches it takes.
    def fallback_reason(self, fb: ForwardBatch) -> str | None:
        """None if `replay(fb)` can run the batch, else why it must run eager."""
        return self.inputs.fallback_reason(fb)

    def can_run(self, fb: ForwardBatch) -> bool:
        return self.fallback_reason(fb) is None

    def bucket_for(self, n: int) -> int:
        return self.inputs.bucket_for(n)

    # Report.
    def report(self) -> dict:
        return {
            "runner": type(self).__name__,
            "backend": self.backend_name,
            "buckets": list(self.buckets),
            "padding": self.inputs.padding,
            "capture_seconds": {bs: round(s, 3) for bs, s in sorted(self.capture_seconds.items())},
            "capture_seconds_total": round(sum(self.capture_seconds.values()), 3),
            "memory_bytes": self.memory_bytes,
            "replay_count": self.replay_count,
        }

    def log_report(self) -> None:
        r = self.report()
        per_bucket = ", ".join(f"{bs}: {s:.2f}s" for bs, s in r["capture_seconds"].items())
        logger.info(
            "decode graph runner ready\n  runner: %s (compile backend: %s)\n  buckets: %s%s\n"
            "  capture time per bucket: %s\n  capture total: %.1fs, memory taken: %.1f MiB",
            r["runner"], r["backend"], r["buckets"], "" if self.padding else " (no padding)",
            per_bucket, r["capture_seconds_total"], r["memory_bytes"] / 2**20,
        )
