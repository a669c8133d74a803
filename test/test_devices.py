"""Device discovery: the JSON-able report, the CLI, and the errors for absent devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from airserve.srt import hardware


def by_name(entries: list[dict]) -> dict[str, dict]:
    return {d["name"]: d for d in entries}


def test_discover_is_json_and_lists_every_known_device():
    info = hardware.discover()
    assert json.loads(json.dumps(info)) == info
    torch_devices = by_name(info["torch"]["devices"])
    assert set(torch_devices) == {"cpu", "cuda", "xpu", "npu"}
    assert torch_devices["cpu"]["available"]
    for d in torch_devices.values():
        assert d["available"] or d["reason"]  # an unavailable device always says why
    ov = info["openvino"]
    if ov["installed"]:
        ov_devices = by_name(ov["devices"])
        assert ov_devices["CPU"]["available"] and ov_devices["CPU"]["full_name"]
        assert {"GPU", "NPU"} <= {n.split(".")[0] for n in ov_devices}
        for d in ov_devices.values():
            assert d["available"] or d["reason"]


def test_cpu_only_torch_says_why_cuda_is_missing():
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this torch has CUDA")
    cuda = by_name(hardware.discover()["torch"]["devices"])["cuda"]
    assert not cuda["available"] and "built without CUDA" in cuda["reason"]


def test_cli_prints_the_table_and_json():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-m", "airserve.devices"], capture_output=True,
                         text=True, check=True, env=env).stdout
    assert "cpu" in out and "available" in out
    raw = subprocess.run([sys.executable, "-m", "airserve.devices", "--json"],
                         capture_output=True, text=True, check=True, env=env).stdout
    assert by_name(json.loads(raw)["torch"]["devices"])["cpu"]["available"]


def test_npu_device_never_imports_torch_npu_here():
    """torch-npu without CANN breaks the process that imports it: only a child may import it.
    torch-npu is not installed here, which the entry must say."""
    npu = hardware._npu_device()
    assert "torch_npu" not in sys.modules
    assert npu["name"] == "npu"
    if hardware.importlib.util.find_spec("torch_npu") is None:
        assert not npu["available"] and "not installed" in npu["reason"]


# What a probe child prints when torch_npu fails to load (the last line of its traceback).
MISSING_CANN = ("Traceback (most recent call last):\n  File \"<string>\", line 1, in <module>\n"
                "OSError: libhccl.so: cannot open shared object file: No such file or directory\n")
WRONG_TORCH = ("ImportError: /usr/local/lib/python3.11/site-packages/torch_npu/lib/"
               "libtorch_npu.so: undefined symbol: _ZN3c1015SmallVectorBase8grow_podEPKvmm")


def test_npu_reason_for_missing_cann_says_to_source_set_env():
    reason = hardware._npu_reason(MISSING_CANN)
    assert "CANN" in reason and "set_env.sh" in reason
    assert "libhccl.so: cannot open shared object file" in reason
    assert "Traceback" not in reason  # only the error line


def test_npu_reason_for_another_torch_names_the_matching_torch_npu():
    import torch

    reason = hardware._npu_reason(WRONG_TORCH)
    assert "another torch version" in reason and "undefined symbol" in reason
    assert f"torch-npu=={torch.__version__.split('+')[0]}" in reason


def test_npu_reason_without_error_text_still_says_how_to_fix():
    reason = hardware._npu_reason("")
    assert "torch_npu failed to import" in reason and "set_env.sh" in reason


def test_without_openvino_discovery_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)
    ov = hardware.discover()["openvino"]
    assert not ov["installed"] and "pip install openvino==2026.4.1" in ov["reason"]
    with pytest.raises(RuntimeError, match=r"pip install openvino==2026\.4\.1"):
        hardware.check_openvino_device("CPU")


try:
    import openvino

    AVAILABLE = openvino.Core().available_devices
except ImportError:
    openvino, AVAILABLE = None, []
needs_openvino = pytest.mark.skipif(openvino is None, reason="openvino is not installed")


@needs_openvino
def test_check_openvino_device_accepts_listed_devices():
    assert hardware.check_openvino_device("CPU") == "CPU"
    assert hardware.check_openvino_device("cpu") == "CPU"


@needs_openvino
@pytest.mark.skipif(any(d.startswith("GPU") for d in AVAILABLE), reason="has an Intel GPU")
def test_absent_gpu_names_the_missing_driver_and_lists_devices():
    with pytest.raises(RuntimeError) as e:
        hardware.check_openvino_device("GPU.7")
    msg = str(e.value)
    assert "--openvino-device GPU.7 is not available" in msg
    assert "OpenVINO devices here: CPU (" in msg
    assert "libOpenCL.so.1" in msg or "/dev/dri" in msg or "intel-opencl-icd" in msg


@needs_openvino
@pytest.mark.skipif(any(d.startswith("NPU") for d in AVAILABLE), reason="has an Intel NPU")
def test_absent_npu_names_the_missing_driver():
    with pytest.raises(RuntimeError, match="linux-npu-driver|Level Zero|/dev/accel"):
        hardware.check_openvino_device("NPU")


@needs_openvino
def test_virtual_devices_are_refused_with_the_reason():
    with pytest.raises(RuntimeError, match="AUTO is a virtual device"):
        hardware.check_openvino_device("AUTO")
