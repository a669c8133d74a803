"""The device table (docs/design.md) and the errors for a requested device that is absent."""

from __future__ import annotations

import builtins
import subprocess
import sys
import types

import pytest
import torch

from airserve.srt.hardware import check_device, import_torch_npu
from airserve.srt.model_executor.graph_runners import registry
from airserve.srt.model_executor.graph_runners.config import RunnerConfig
from airserve.srt.model_executor.graph_runners.registry import select_runner_name
from airserve.srt.server_args import ServerArgs


def config(**kwargs) -> RunnerConfig:
    return RunnerConfig.from_server_args(ServerArgs(**kwargs))

TORCH_VERSION = torch.__version__.split("+")[0]


@pytest.mark.parametrize("kwargs, expected", [
    (dict(device="cpu"), None),
    (dict(device="cpu", enable_torch_compile=True), "cpu_graph"),
    (dict(device="cpu", enable_torch_compile=True, torch_compile_backend="inductor"),
     "cpu_graph"),
    (dict(device="cpu", enable_torch_compile=True, torch_compile_backend="eager"), "cpu_graph"),
    (dict(device="cpu", enable_torch_compile=True, torch_compile_backend="openvino"),
     "openvino"),
    (dict(device="cpu", torch_compile_backend="openvino"), None),  # compile is off
    (dict(device="cuda"), "cuda_graph"),
    (dict(device="cuda", enable_torch_compile=True), "cuda_graph"),
    (dict(device="cuda", disable_cuda_graph=True), None),
    (dict(device="npu"), "npu_graph"),
    (dict(device="npu", disable_cuda_graph=True), None),
    (dict(device="npu", enable_torch_compile=True), "torchair"),
    (dict(device="npu", enable_torch_compile=True, torchair_mode="npugraph_ex"), "torchair"),
])
def test_device_table(kwargs, expected):
    assert select_runner_name(config(**kwargs)) == expected


@pytest.mark.parametrize("kwargs", [
    dict(device="cpu", enable_torch_compile=True, torch_compile_backend="torchair"),
    dict(device="cuda", enable_torch_compile=True, torch_compile_backend="openvino"),
    dict(device="npu", enable_torch_compile=True, torch_compile_backend="inductor"),
])
def test_backend_that_cannot_run_on_the_device_is_an_error(kwargs):
    with pytest.raises(ValueError, match="--torch-compile-backend"):
        select_runner_name(config(**kwargs))


def test_every_runner_is_registered_by_module_and_class():
    names = {"cpu_graph", "openvino", "cuda_graph", "npu_graph", "torchair"}
    assert set(registry.RUNNERS) == names


def test_cpu_passes_the_device_check():
    check_device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_requested_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError) as info:
        check_device("cuda")
    msg = str(info.value)
    assert "torch.cuda.is_available() is False" in msg and "--device cpu" in msg


def _assert_npu_message(msg: str) -> None:
    assert "CANN" in msg and "set_env.sh" in msg
    assert f"torch-npu=={TORCH_VERSION}" in msg
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in msg


def test_npu_requested_here_fails_fast_naming_cann_and_torch_npu():
    if "torch_npu" in sys.modules:
        pytest.skip("torch_npu is importable here")
    with pytest.raises(RuntimeError) as info:
        check_device("npu")
    _assert_npu_message(str(info.value))
    assert "torch_npu" not in sys.modules


def _fail_import(monkeypatch, exc: BaseException) -> None:
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "torch_npu":
            raise exc
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)


@pytest.mark.parametrize("exc, what", [
    (OSError("libhccl.so: cannot open shared object file: No such file or directory"),
     "CANN libraries are not found"),
    (ImportError("libascendcl.so: cannot open shared object file"), "CANN libraries"),
    (ImportError("torch_npu/_C.so: undefined symbol: _ZN3c104impl"), "another torch version"),
])
def test_npu_import_failures_name_the_fix(monkeypatch, exc, what):
    _fail_import(monkeypatch, exc)
    with pytest.raises(RuntimeError) as info:
        import_torch_npu()
    assert what in str(info.value)
    _assert_npu_message(str(info.value))
    assert info.value.__cause__ is exc


def test_npu_version_mismatch(monkeypatch):
    fake = types.ModuleType("torch_npu")
    fake.__version__ = "2.5.1.post2"
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    with pytest.raises(RuntimeError) as info:
        import_torch_npu()
    assert "torch-npu 2.5.1.post2 does not match" in str(info.value)
    _assert_npu_message(str(info.value))


def test_matching_npu_version_imports(monkeypatch):
    fake = types.ModuleType("torch_npu")
    fake.__version__ = f"{TORCH_VERSION}.post1"
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    assert import_torch_npu() is fake


def test_vendor_packages_are_never_imported_for_cpu(tiny_llama_dir):
    code = (
        "import sys\n"
        "from airserve.srt.model_executor.model_runner import ModelRunner\n"
        "from airserve.srt.model_executor.graph_runners import registry, base\n"
        "from airserve.srt.server_args import ServerArgs\n"
        f"ModelRunner(ServerArgs(model_path={tiny_llama_dir!r}, max_total_tokens=256))\n"
        "bad = [m for m in ('torch_npu', 'torchair', 'openvino') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_runner_module_is_a_clear_error(monkeypatch, tiny_llama_dir):
    monkeypatch.setitem(registry.RUNNERS, "openvino",
                        ("airserve.srt.model_executor.no_such_runner", "OpenVINORunner"))
    fake_runner = types.SimpleNamespace(runner_config=config(
        enable_torch_compile=True, torch_compile_backend="openvino"))
    with pytest.raises(RuntimeError, match="OpenVINORunner.*drop --enable-torch-compile"):
        registry.create_graph_runner(fake_runner)
