"""What this machine can run on: torch devices and OpenVINO devices, and why a known one is not.

`python -m airserve.devices` prints the list (`--json` for the raw dict); `discover()` returns
the same as a JSON-able dict (served in /get_server_info). Nothing here imports torch_npu into
this process: a torch-npu without CANN breaks the importing process, so it is probed in a child.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys

OPENVINO_INSTALL = "pip install openvino==2026.4.1 (or the extra airserve[openvino])"
OPENVINO_KNOWN = ("CPU", "GPU", "NPU")
# Virtual OpenVINO devices: the torch.compile openvino backend accepts only devices listed in
# Core().available_devices (else it silently compiles with inductor).
OPENVINO_VIRTUAL = ("AUTO", "MULTI", "HETERO", "BATCH")
NPU_PROBE = (
    "import json, torch\n"
    "from airserve.srt.model_executor.runner_selection import import_torch_npu\n"
    "try:\n"
    "    import_torch_npu()\n"
    "    print(json.dumps({'available': torch.npu.is_available(),\n"
    "                      'count': torch.npu.device_count()}))\n"
    "except RuntimeError as e:\n"
    "    print(json.dumps({'available': False, 'reason': str(e)}))\n"
)


# torch.
def _torch_devices() -> list[dict]:
    import torch

    detail = f"{os.cpu_count()} logical cores, {torch.get_num_threads()} torch threads"
    return [
        {"name": "cpu", "available": True, "count": 1, "detail": detail},
        _torch_accelerator(
            "cuda", torch.version.cuda is not None,
            f"torch {torch.__version__} is built without CUDA",
            "no CUDA device visible: check the NVIDIA driver (nvidia-smi) and "
            "CUDA_VISIBLE_DEVICES"),
        _torch_accelerator(
            "xpu", hasattr(torch, "xpu") and getattr(torch._C, "_has_xpu", False),
            f"torch {torch.__version__} is built without XPU support",
            "no Intel GPU visible to torch.xpu: check the Intel GPU driver and /dev/dri"),
        _npu_device(),
    ]


def _torch_accelerator(name: str, built: bool, not_built: str, not_visible: str) -> dict:
    """The entry of `torch.<name>` (cuda, xpu): unavailable with why, or its count and the name
    of its first device."""
    import torch

    if not built:
        return {"name": name, "available": False, "reason": not_built}
    module = getattr(torch, name)
    if not module.is_available():
        return {"name": name, "available": False, "reason": not_visible}
    return {"name": name, "available": True, "count": module.device_count(),
            "detail": module.get_device_name(0)}


def _npu_device() -> dict:
    # A missing spec does prove torch-npu is absent; a present one proves nothing (see NPU_PROBE).
    if importlib.util.find_spec("torch_npu") is None:
        return {"name": "npu", "available": False,
                "reason": "torch-npu is not installed (pip install airserve[npu]; needs Ascend "
                          "CANN sourced)"}
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    try:
        proc = subprocess.run([sys.executable, "-c", NPU_PROBE], env=env, capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        return {"name": "npu", "available": False,
                "reason": f"probing torch-npu in a subprocess failed ({type(e).__name__})"}
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):  # the child died before it could report
        error = proc.stderr or f"the probe process exited with code {proc.returncode}"
        return {"name": "npu", "available": False, "reason": _npu_reason(error)}
    result["name"] = "npu"
    return result


def _npu_reason(error_text: str) -> str:
    """Why torch_npu cannot load, from the failure text of the probe child (a traceback, whose
    last line is the error, or a loader's message), and what fixes it."""
    from airserve.srt.model_executor.runner_selection import torch_npu_import_failure

    lines = [line.strip() for line in error_text.strip().splitlines() if line.strip()]
    return torch_npu_import_failure(lines[-1] if lines else "no error text")


# OpenVINO.
def _openvino() -> dict:
    try:
        import openvino
    except ImportError as e:
        return {"installed": False, "devices": [], "reason": f"{e}; {OPENVINO_INSTALL}"}
    core = openvino.Core()
    devices = []
    for name in core.available_devices:
        entry = {"name": name, "available": True}
        for key, prop in (("full_name", "FULL_DEVICE_NAME"),
                          ("capabilities", "OPTIMIZATION_CAPABILITIES")):
            try:
                value = core.get_property(name, prop)
                entry[key] = list(value) if isinstance(value, (list, tuple)) else str(value)
            except Exception:  # a plugin that cannot answer one property
                pass
        devices.append(entry)
    present = {d["name"].split(".")[0] for d in devices}
    for kind in OPENVINO_KNOWN:
        if kind not in present:
            devices.append({"name": kind, "available": False,
                            "reason": _openvino_missing_reason(core, kind)})
    return {"installed": True, "version": openvino.get_version(), "devices": devices}


def _openvino_missing_reason(core, kind: str) -> str:
    try:
        core.get_property(kind, "FULL_DEVICE_NAME")
        plugin_error = ""
    except Exception as e:
        plugin_error = str(e)
    if kind == "GPU":
        if "libOpenCL.so" in plugin_error:
            return ("the OpenCL loader libOpenCL.so.1 is missing: install the Intel GPU compute "
                    "runtime (intel-opencl-icd) and an OpenCL ICD loader (ocl-icd-libopencl1)")
        if not glob.glob("/dev/dri/renderD*"):
            return ("no /dev/dri/renderD* node: no Intel GPU visible (i915/xe kernel driver not "
                    "loaded, or the container was started without /dev/dri)")
        return ("OpenCL loads but OpenVINO finds no Intel GPU: install or update the Intel GPU "
                "compute runtime (intel-opencl-icd)")
    if kind == "NPU":
        if not glob.glob("/dev/accel/accel*"):
            return ("no /dev/accel/accel* node: no Intel NPU visible (intel_vpu kernel driver "
                    "and the linux-npu-driver user-space packages not installed, or the "
                    "container was started without /dev/accel)")
        if "libze_loader" in plugin_error or "level" in plugin_error.lower():
            return ("the Level Zero loader (libze_loader.so.1) is missing: install level-zero "
                    "and the Intel NPU driver (linux-npu-driver)")
        return "OpenVINO finds no NPU: install or update the Intel NPU driver (linux-npu-driver)"
    return plugin_error.strip().splitlines()[-1] if plugin_error else "not found"


def discover() -> dict:
    """Every device this process could run on, as a JSON-able dict:
    {"torch": {"version", "devices": [...]}, "openvino": {"installed", "version",
    "devices": [...]}}; each device has "name", "available", and "reason" when unavailable."""
    import torch

    return {"torch": {"version": torch.__version__, "devices": _torch_devices()},
            "openvino": _openvino()}


def check_openvino_device(name: str) -> str:
    """`name` if OpenVINO can compile for it here, else a RuntimeError listing the devices
    there are and naming what is missing (the stock backend would silently use inductor)."""
    info = _openvino()
    if not info["installed"]:
        raise RuntimeError(f"--torch-compile-backend openvino needs openvino: {info['reason']}")
    available = [d for d in info["devices"] if d["available"]]
    names = [d["name"] for d in available]
    for known in names:  # OpenVINO's names are upper case; accept "cpu" for "CPU"
        if name.upper() == known.upper():
            return known
    listing = ", ".join(f"{d['name']} ({d.get('full_name', '?')})" for d in available) or "none"
    kind = name.split(".")[0].split(":")[0].upper()
    if kind in OPENVINO_VIRTUAL:
        why = (f"{kind} is a virtual device; the torch.compile openvino backend compiles for one "
               "device listed by openvino.Core().available_devices: name it")
    elif kind in present_kinds(names):
        why = f"{name} is not one of the {kind} devices here"
    else:
        missing = [d for d in info["devices"] if not d["available"] and d["name"] == kind]
        why = f"{kind}: {missing[0]['reason']}" if missing else f"{name} is not an OpenVINO device"
    raise RuntimeError(f"--openvino-device {name} is not available: {why}. OpenVINO devices "
                       f"here: {listing}. See `python -m airserve.devices`.")


def present_kinds(names: list[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


def format_report(info: dict) -> str:
    lines = [f"torch {info['torch']['version']}"]
    for d in info["torch"]["devices"]:
        lines.append(_line(d, d.get("detail", "")))
    ov = info["openvino"]
    if not ov["installed"]:
        lines.append(f"openvino: not installed ({ov['reason']})")
        return "\n".join(lines)
    lines.append(f"openvino {ov['version']}")
    for d in ov["devices"]:
        lines.append(_line(d, d.get("full_name", "")))
    return "\n".join(lines)


def _line(d: dict, detail: str) -> str:
    if d["available"]:
        count = f" x{d['count']}" if d.get("count", 1) > 1 else ""
        return f"  {d['name']:<8} available{count}  {detail}".rstrip()
    return f"  {d['name']:<8} unavailable  {d['reason']}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="List the devices airserve can run on here.")
    parser.add_argument("--json", action="store_true", help="print the raw dict as JSON")
    args = parser.parse_args(argv)
    info = discover()
    print(json.dumps(info, indent=2) if args.json else format_report(info))


if __name__ == "__main__":
    main()
