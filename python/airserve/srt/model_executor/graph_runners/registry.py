"""Which decode graph runner a configuration gets, and where each runner lives.

`RUNNERS` maps a runner name to its module and class, imported on first use, so
`import airserve` never imports torch_npu, torchair or openvino. `RUNNER_TABLE` is the
device/runner table: (device, torch.compile backend or None when compile is off) -> runner.
Both feed the command line (`DEVICES`, `COMPILE_BACKENDS`, `DEFAULT_COMPILE_BACKEND` in
server_args.py). Adding a runner is its file plus one line in `RUNNERS` (and its rows here).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from airserve.srt.model_executor.graph_runners.base import GraphRunner
    from airserve.srt.model_executor.graph_runners.config import RunnerConfig
    from airserve.srt.model_executor.model_runner import ModelRunner

_PKG = "airserve.srt.model_executor.graph_runners"
# Runner name -> (module, class), imported lazily.
RUNNERS = {
    "cpu_graph": (f"{_PKG}.cpu", "CPUGraphRunner"),
    "openvino": (f"{_PKG}.openvino.runner", "OpenVINORunner"),
    "cuda_graph": (f"{_PKG}.cuda", "CudaGraphRunner"),
    "npu_graph": (f"{_PKG}.npu", "NPUGraphRunner"),
    "torchair": (f"{_PKG}.torchair.runner", "TorchAirRunner"),
}

# (device, compile backend; None: --enable-torch-compile off) -> runner name (None: eager).
RUNNER_TABLE: dict[tuple[str, str | None], str | None] = {
    ("cpu", None): None,
    ("cpu", "inductor"): "cpu_graph",
    ("cpu", "eager"): "cpu_graph",
    ("cpu", "openvino"): "openvino",
    # torch.compile on cuda only runs inside the captured graphs, as in SGLang.
    ("cuda", None): "cuda_graph",
    ("cuda", "inductor"): "cuda_graph",
    ("cuda", "eager"): "cuda_graph",
    ("npu", None): "npu_graph",
    ("npu", "torchair"): "torchair",
}
# Runners that capture device graphs: --disable-cuda-graph turns them off (decode runs eager).
CAPTURED_GRAPH_RUNNERS = frozenset({"cuda_graph", "npu_graph"})
DEFAULT_COMPILE_BACKEND = {"cpu": "inductor", "cuda": "inductor", "npu": "torchair"}
DEVICES = tuple(dict.fromkeys(device for device, _ in RUNNER_TABLE))
COMPILE_BACKENDS = tuple(dict.fromkeys(b for _, b in RUNNER_TABLE if b is not None))


def select_runner_name(config: RunnerConfig) -> str | None:
    """The runner for `config` (a key of RUNNERS), or None for eager decode."""
    backend = config.compile_backend if config.enable_torch_compile else None
    key = (config.device, backend)
    if key not in RUNNER_TABLE:
        usable = [b for d, b in RUNNER_TABLE if d == config.device and b is not None]
        raise ValueError(f"--torch-compile-backend {backend} does not run on {config.device}; "
                         f"use {' or '.join(usable)} (default "
                         f"{DEFAULT_COMPILE_BACKEND[config.device]})")
    name = RUNNER_TABLE[key]
    if name in CAPTURED_GRAPH_RUNNERS and config.disable_cuda_graph:
        return None
    return name


def runner_class(name: str) -> type[GraphRunner]:
    """Import the runner `name` (a key of RUNNERS) and return its class."""
    module_name, class_name = RUNNERS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise RuntimeError(f"the {class_name} runner ({module_name}) is not part of this "
                           "build; drop --enable-torch-compile or choose another "
                           "--torch-compile-backend") from e
    return getattr(module, class_name)


def create_graph_runner(model_runner: ModelRunner) -> GraphRunner | None:
    name = select_runner_name(model_runner.runner_config)
    return None if name is None else runner_class(name)(model_runner)
