"""The compile-backend seam of TorchAirRunner, and the torchair import and config behind it.

`get_compile_backend(args, num_buckets)` is the one place that decides which compiler a decode
bucket goes to: torchair's NPU backend on `--device npu`, inductor elsewhere. Tests hand
TorchAirRunner their own backend (inductor, or a function that records each FX graph) instead;
that is the only difference between the CPU test run and the NPU run.

Facts used here, checked against Ascend/torchair's python/torchair sources:
- `get_npu_backend(compiler_config=cfg)` returns a torch.compile backend
  (`npu_fx_compiler.get_npu_backend`); `cfg.mode` picks GE ("max-autotune", the default) or
  ACL-graph capture: "reduce-overhead" in every release, and from torch-npu 2.13.0 on also
  "npugraph_ex", the same capture path under its new name (its options map onto
  `debug.aclgraph.*`, `configs/npugraphex_config.py`). Older releases accept only the first
  two, which `_set_mode` falls back to.
- Options are `OptionValue`s: assigning a value outside the allowed list raises ValueError
  (`configs/_option_base.py`).
- `debug.run_eagerly`, `debug.fx_summary` (with `skip_compile`) and `debug.data_dump` make the
  backend hand back the FX graph to run eagerly, with only a log line (`_get_compiled_gm`).
- In ACL-graph mode a graph recaptured more than `debug.aclgraph.static_capture_size_limit`
  times (default 64) runs eagerly from then on, with only a warning (`_acl_concrete_graph`).
- `tiling_schedule_optimize` is GE-only (`compiler_config.unsupport_aclgraphconfig_list`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from airserve.srt.hardware import import_torchair
from airserve.srt.model_executor.graph_runners.config import RunnerConfig

logger = logging.getLogger(__name__)

# torchair's default debug.aclgraph.static_capture_size_limit.
DEFAULT_CAPTURE_LIMIT = 64
# Config leaves that turn the torchair backend into an eager fallback, and the value each must
# hold for the graph to really be compiled.
EAGER_SWITCHES = {"debug.run_eagerly": "0", "debug.fx_summary.type": None,
                  "debug.data_dump.type": None}


@dataclass
class CompileBackend:
    """What TorchAirRunner compiles each bucket with."""

    name: str  # for logs and the report, e.g. "torchair (max-autotune)", "inductor"
    backend: Callable | str  # the torch.compile backend
    # (bound method, cache dir) -> compiled callable that loads/saves an on-disk cache; only
    # torchair has one (`torchair.inference.cache_compile`).
    cache_compile: Callable[[Callable, str], Callable] | None = None
    mode: str = ""  # torchair mode, part of the compile-cache key
    options: dict[str, Any] = field(default_factory=dict)  # compiler options, also keyed


def as_compile_backend(backend: CompileBackend | Callable | str) -> CompileBackend:
    """Wrap a plain torch.compile backend (a name or a function) for TorchAirRunner."""
    if isinstance(backend, CompileBackend):
        return backend
    name = backend if isinstance(backend, str) else getattr(backend, "__name__",
                                                             type(backend).__name__)
    return CompileBackend(name=name, backend=backend)


def get_compile_backend(args: RunnerConfig, num_buckets: int) -> CompileBackend:
    """The compiler for TorchAirRunner's buckets: torchair on npu, inductor (or eager) on cpu."""
    if args.device != "npu":
        name = args.compile_backend
        if name not in ("inductor", "eager"):
            raise ValueError(f"TorchAirRunner on --device {args.device} compiles with inductor "
                             f"or eager, not {name}")
        return CompileBackend(name=name, backend=name)
    torchair = import_torchair()
    # Precompiled operator binaries, not online compilation, as vllm-ascend's torchair runner
    # set before compiling (torchair_model_runner._get_torchair_lazy_compiled_model).
    torch.npu.set_compile_mode(jit_compile=False)
    cfg = build_compiler_config(torchair.CompilerConfig(), args, num_buckets)
    backend = torchair.get_npu_backend(compiler_config=cfg)
    mode = str(cfg.mode.value)
    return CompileBackend(
        name=f"torchair ({mode})", backend=backend,
        cache_compile=functools.partial(_cache_compile, torchair, cfg), mode=mode,
        options=config_summary(cfg))


def _cache_compile(torchair, cfg, method: Callable, cache_dir: str) -> Callable:
    # cache_compile(func, *, config, dynamic, cache_dir, ...) takes a bound nn.Module method
    # and keys its cache by the module's repr, the config and the method's __name__ only
    # (inference/_cache_compiler.py `CompiledModel.get_cache_bin`): the runner gives each bucket
    # its own renamed method and directory, and its own key covers the rest (torchair/cache.py).
    return torchair.inference.cache_compile(method, config=cfg, dynamic=True,
                                            cache_dir=cache_dir)


def build_compiler_config(cfg, args: RunnerConfig, num_buckets: int):
    """Fill a `torchair.CompilerConfig()` from the flags; raise if it would run eagerly."""
    mode = _set_mode(cfg, args.torchair_mode)
    _set_option(cfg, "experimental_config.frozen_parameter", args.torchair_frozen_parameter)
    # The KV writes are mutations of graph inputs (the cache tensors): keep them in the graph
    # instead of copying the cache back after every step.
    _set_option(cfg, "experimental_config.keep_inference_input_mutations", True)
    if mode == "max-autotune":
        # Tiling sinking: FIA's tiling depends on the host seq lengths; with it the GE graph
        # stays static (torchair docs, "模型中存在FA算子，如何执行整图静态下沉调度", path 4).
        _set_option(cfg, "experimental_config.tiling_schedule_optimize",
                    args.torchair_tiling_schedule_optimize)
        if not args.torchair_tiling_schedule_optimize:
            logger.info("torchair max-autotune without --torchair-tiling-schedule-optimize: "
                        "FIA is scheduled from the host each step (a dynamic GE graph)")
    else:
        if args.torchair_tiling_schedule_optimize:
            logger.warning("--torchair-tiling-schedule-optimize only applies to "
                           "--torchair-mode max-autotune; ignored in %s", mode)
        # One graph per bucket, captured once; keep the limit above the bucket count anyway so
        # it can never silently switch a bucket to eager.
        limit = max(DEFAULT_CAPTURE_LIMIT, num_buckets + 1)
        _set_option(cfg, "debug.aclgraph.static_capture_size_limit", limit)
    check_not_eager(cfg)
    return cfg


def _set_mode(cfg, mode: str) -> str:
    if mode == "reduce-overhead":
        logger.warning("--torchair-mode reduce-overhead is torchair's deprecated name for "
                       "ACL-graph capture; use npugraph_ex")
    if mode == "npugraph_ex":
        try:
            cfg.mode = "npugraph_ex"
            return mode
        except Exception:  # an OptionValue outside the allowed list (ValueError)
            # This torchair exposes the same capture path as mode "reduce-overhead" only.
            logger.info("this torchair has no mode npugraph_ex; using its ACL-graph capture "
                        "mode reduce-overhead, which npugraph_ex is built on")
            mode = "reduce-overhead"
    try:
        cfg.mode = mode
    except Exception as e:
        raise RuntimeError(f"--torchair-mode {mode} is not supported by the installed torchair "
                           f"({e}); use max-autotune or upgrade torch-npu") from e
    return mode


def _set_option(cfg, path: str, value) -> None:
    *parents, leaf = path.split(".")
    node = cfg
    try:
        for name in parents:
            node = getattr(node, name)
        setattr(node, leaf, value)
    except (AttributeError, ValueError) as e:
        raise RuntimeError(f"the installed torchair has no option {path} ({e}); install a "
                           "torch-npu release matching torch (see docs/ascend.md)") from e


def _get_option(cfg, path: str):
    node = cfg
    for name in path.split("."):
        node = getattr(node, name, None)
        if node is None:
            return None
    return getattr(node, "value", node)


def check_not_eager(cfg) -> None:
    """torchair hands back the FX graph (eager) when any of EAGER_SWITCHES is set."""
    for path, wanted in EAGER_SWITCHES.items():
        value = _get_option(cfg, path)
        if value is not None and value != wanted:
            raise RuntimeError(
                f"torchair config {path}={value} makes the backend run the decode step eagerly; "
                "unset it (TorchAirRunner never runs eager silently), or drop "
                "--enable-torch-compile to run the NPU graph runner")


def config_summary(cfg) -> dict[str, Any]:
    """The compiler options that change the compiled graph (for logs and the cache key)."""
    paths = ("mode", "experimental_config.frozen_parameter",
             "experimental_config.keep_inference_input_mutations",
             "experimental_config.tiling_schedule_optimize",
             "debug.aclgraph.static_capture_size_limit")
    return {p: _get_option(cfg, p) for p in paths}
