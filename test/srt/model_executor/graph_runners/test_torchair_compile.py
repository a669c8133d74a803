"""The compile-backend factory's flag mapping and its import guards, on CPU.

No torch_npu or torchair stands in here. The option tree below mirrors torchair's
NpuBaseConfig/OptionValue behaviour (configs/_option_base.py):
assigning to an existing option sets its value, a value outside its allowed list raises
ValueError, an unknown option raises ValueError.
"""

from __future__ import annotations

import importlib.abc
import sys
import types

import pytest
import torch

from airserve.srt.hardware import import_torchair
from airserve.srt.model_executor.graph_runners.config import RunnerConfig
from airserve.srt.model_executor.graph_runners.torchair.compile import (
    build_compiler_config,
    check_not_eager,
    get_compile_backend,
)
from airserve.srt.server_args import ServerArgs

TORCH_VERSION = torch.__version__.split("+")[0]


class Opt:
    def __init__(self, default, allowed=None):
        self._value, self.allowed = default, allowed

    @property
    def value(self):
        if isinstance(self._value, bool):
            return "1" if self._value else "0"
        return None if self._value is None else str(self._value)

    @value.setter
    def value(self, v):
        if self.allowed is not None and v not in self.allowed:
            raise ValueError(f"{v!r} not in optional list {self.allowed!r}")
        self._value = v


class Node:
    def __init__(self, **options):
        self.__dict__.update(options)

    def __setattr__(self, key, value):
        if key not in self.__dict__:
            raise ValueError(f"{type(self).__name__} has no option {key}")
        current = self.__dict__[key]
        if isinstance(current, Opt):
            current.value = value
        else:
            self.__dict__[key] = value


def fake_compiler_config(modes=("max-autotune", "reduce-overhead")):
    return Node(
        mode=Opt("max-autotune", list(modes)),
        debug=Node(run_eagerly=Opt(False), fx_summary=Node(type=Opt(None)),
                   data_dump=Node(type=Opt(None)),
                   aclgraph=Node(static_capture_size_limit=Opt(64))),
        experimental_config=Node(frozen_parameter=Opt(False),
                                 keep_inference_input_mutations=Opt(False),
                                 tiling_schedule_optimize=Opt(False)),
    )


def npu_args(**kw) -> RunnerConfig:
    return RunnerConfig.from_server_args(ServerArgs(device="npu", enable_torch_compile=True,
                                                    **kw))


# The mapping from flags to torchair options is ours; it is tested on a plain option tree with
# torchair's assignment rules. Applying it to torchair's real CompilerConfig needs an NPU.
def test_default_mode_is_ge_with_frozen_weights_and_in_graph_kv_writes():
    cfg = build_compiler_config(fake_compiler_config(),
                                npu_args(torchair_tiling_schedule_optimize=True), 5)
    assert cfg.mode.value == "max-autotune"
    assert cfg.experimental_config.frozen_parameter.value == "1"
    assert cfg.experimental_config.keep_inference_input_mutations.value == "1"
    assert cfg.experimental_config.tiling_schedule_optimize.value == "1"


def test_frozen_parameter_flag_off():
    cfg = build_compiler_config(fake_compiler_config(),
                                npu_args(torchair_frozen_parameter=False), 5)
    assert cfg.experimental_config.frozen_parameter.value == "0"


def test_npugraph_ex_falls_back_to_reduce_overhead_and_raises_the_capture_limit():
    cfg = build_compiler_config(fake_compiler_config(), npu_args(
        torchair_mode="npugraph_ex", torchair_tiling_schedule_optimize=True), 80)
    assert cfg.mode.value == "reduce-overhead"
    assert int(cfg.debug.aclgraph.static_capture_size_limit.value) >= 81
    assert cfg.experimental_config.tiling_schedule_optimize.value == "0"  # GE only


def test_npugraph_ex_used_when_torchair_has_it():
    modes = ("max-autotune", "reduce-overhead", "npugraph_ex")
    cfg = build_compiler_config(fake_compiler_config(modes),
                                npu_args(torchair_mode="npugraph_ex"), 3)
    assert cfg.mode.value == "npugraph_ex"
    assert int(cfg.debug.aclgraph.static_capture_size_limit.value) == 64


def test_missing_option_names_the_fix():
    cfg = fake_compiler_config()
    del cfg.__dict__["experimental_config"]
    with pytest.raises(RuntimeError, match="no option experimental_config"):
        build_compiler_config(cfg, npu_args(), 3)


@pytest.mark.parametrize("path", ["run_eagerly", "fx_summary", "data_dump"])
def test_configs_that_run_eagerly_are_refused(path):
    cfg = fake_compiler_config()
    if path == "run_eagerly":
        cfg.debug.run_eagerly = True
    else:
        getattr(cfg.debug, path).type = "csv" if path == "fx_summary" else "npy"
    with pytest.raises(RuntimeError, match="eagerly"):
        check_not_eager(cfg)


def test_cpu_gets_inductor():
    backend = get_compile_backend(
        RunnerConfig.from_server_args(ServerArgs(device="cpu", enable_torch_compile=True)), 3)
    assert backend.backend == "inductor" and backend.cache_compile is None


# Import failures: each names its fix.
def test_torch_npu_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(RuntimeError) as err:
        import_torchair()
    for needed in ("torch-npu is not installed", f"torch-npu=={TORCH_VERSION}", "CANN",
                   "set_env.sh"):
        assert needed in str(err.value)


class _Failing(importlib.abc.MetaPathFinder):
    def __init__(self, error: Exception) -> None:
        self.error = error

    def find_spec(self, name, path=None, target=None):
        if name == "torch_npu":
            raise self.error
        return None


@pytest.mark.parametrize("error, what", [
    (OSError("libhccl.so: cannot open shared object file: No such file or directory"),
     "CANN libraries are not found"),
    (ImportError("torch_npu/_C.so: undefined symbol: _ZN3c104impl"),
     "built for another torch version"),
])
def test_torch_npu_that_fails_to_load(monkeypatch, error, what):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Failing(error), *sys.meta_path])
    with pytest.raises(RuntimeError) as err:
        import_torchair()
    assert what in str(err.value) and "set_env.sh" in str(err.value)


class LazyTorchair(types.ModuleType):
    """A torchair whose import succeeds and whose first attribute fails, as torch-npu's lazy
    module does when protobuf is missing."""

    def __getattr__(self, name):
        raise ImportError("No module named 'google.protobuf'")


def fake_torch_npu(monkeypatch, dynamo_torchair=None) -> None:
    npu = types.ModuleType("torch_npu")
    npu.__version__ = f"{TORCH_VERSION}.post1"
    dynamo = types.ModuleType("torch_npu.dynamo")
    if dynamo_torchair is not None:
        dynamo.torchair = dynamo_torchair
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    monkeypatch.setitem(sys.modules, "torch_npu.dynamo", dynamo)
    monkeypatch.setitem(sys.modules, "torchair", LazyTorchair("torchair"))


def test_broken_lazy_torchair_fails_at_import_naming_protobuf(monkeypatch):
    fake_torch_npu(monkeypatch)
    with pytest.raises(RuntimeError) as err:
        import_torchair()
    msg = str(err.value)
    assert "google.protobuf" in msg and "airserve[npu]" in msg
    assert "--enable-torch-compile" in msg


def test_torchair_inside_torch_npu_is_the_fallback(monkeypatch):
    working = types.ModuleType("torch_npu.dynamo.torchair")
    working.get_npu_backend = lambda **kw: "backend"
    fake_torch_npu(monkeypatch, dynamo_torchair=working)
    assert import_torchair() is working
