"""Devices and vendor packages: what this machine can run on, and the guarded vendor imports.

Two halves, one module (runners, attention backends, the server and `python -m airserve.devices`
all use it):
- Discovery: `discover()` lists torch and OpenVINO devices as a JSON-able dict (served in
  /get_server_info, printed by `python -m airserve.devices`), each unavailable one with why.
  It never imports torch_npu into this process: a torch-npu without CANN breaks the importing
  process, so it is probed in a child.
- Guards: `check_device`, `import_torch_npu`, `import_torchair`, `require_openvino` and
  `check_openvino_device` import or probe on first use and raise one error naming what fixes it.
  `import airserve` imports none of the vendor packages.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import platform
import subprocess
import sys

OPENVINO_VERSION = "2026.4.1"
OPENVINO_INSTALL = (f"pip install openvino=={OPENVINO_VERSION} (or the extra "
                    "airserve[openvino])")
OPENVINO_KNOWN = ("CPU", "GPU", "NPU")
# Virtual OpenVINO devices: the torch.compile openvino backend accepts only devices listed in
# Core().available_devices (else it silently compiles with inductor).
OPENVINO_VIRTUAL = ("AUTO", "MULTI", "HETERO", "BATCH")
NPU_PROBE = (
    "import json, torch\n"
    "from airserve.srt.hardware import import_torch_npu\n"
    "try:\n"
    "    import_torch_npu()\n"
    "    print(json.dumps({'available': torch.npu.is_available(),\n"
    "                      'count': torch.npu.device_count()}))\n"
    "except RuntimeError as e:\n"
    "    print(json.dumps({'available': False, 'reason': str(e)}))\n"
)


# torch.
def host_cpu() -> tuple[str, frozenset[str]]:
    """This machine's CPU model name and instruction-set flags, from /proc/cpuinfo (Linux);
    elsewhere the platform's processor name and no flags."""
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return model, flags


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


DISCOVER_CHILD = ("import json\n"
                  "from airserve.srt.hardware import discover\n"
                  "print(json.dumps(discover()))\n")


def discover_in_child(timeout: float = 300) -> dict:
    """`discover()` run in a child process, for a process that should not hold torch and
    OpenVINO (the HTTP process: together they keep ~300 MiB resident for the server's life).
    Raises RuntimeError with the child's last error line when it fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", DISCOVER_CHILD], env=env, capture_output=True,
                          text=True, timeout=timeout)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        raise RuntimeError(f"device discovery exited with code {proc.returncode}: "
                           f"{lines[-1] if lines else 'no error text'}") from None


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


# Guards: each imports or probes on first use and raises one error naming the fix.
NPU_INSTALL_HINT = (
    "install torch-npu=={torch_version} (it must match torch's version), install Ascend CANN "
    "and source its set_env.sh (e.g. `source /usr/local/Ascend/ascend-toolkit/set_env.sh`) "
    "before starting; to use other devices on a host with torch-npu but no CANN, set "
    "TORCH_DEVICE_BACKEND_AUTOLOAD=0"
)


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def check_device(device: str) -> None:
    """Raise a clear error if `device` is absent; never switch devices silently."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (a CPU-only build)"
        raise RuntimeError(
            f"--device cuda was requested but torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, built with {built}). Install a CUDA build of torch and check "
            "the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES, or use --device cpu."
        )
    if device == "npu":
        import_torch_npu()
        if not torch.npu.is_available():
            raise RuntimeError("--device npu was requested but torch.npu.is_available() is "
                               "False: check the Ascend driver (npu-smi info) and "
                               "ASCEND_RT_VISIBLE_DEVICES, or use --device cpu")


def import_torch_npu():
    """Import torch_npu or raise one error naming what is missing and how to fix it.

    Only an import tells: torch_npu may be installed and still fail to load (no CANN libraries,
    or built for another torch), so `importlib.util.find_spec` is no availability check.
    """
    hint = NPU_INSTALL_HINT.format(torch_version=_torch_version())
    try:
        import torch_npu
    except ModuleNotFoundError as e:
        if e.name != "torch_npu":
            raise RuntimeError(f"--device npu: torch_npu failed to import ({e}); {hint}") from e
        raise RuntimeError(f"--device npu was requested but torch-npu is not installed; "
                           f"{hint}") from e
    except (ImportError, OSError) as e:
        raise RuntimeError(f"--device npu: {torch_npu_import_failure(str(e))}") from e
    npu_version = getattr(torch_npu, "__version__", "").split("+")[0]
    if npu_version.split(".")[:2] != _torch_version().split(".")[:2]:
        raise RuntimeError(f"--device npu: torch-npu {npu_version} does not match torch "
                           f"{_torch_version()}; {hint}")
    return torch_npu


def torch_npu_import_failure(error: str) -> str:
    """What the error of importing torch_npu (`error`: its message) means, and how to fix it."""
    if any(lib in error for lib in ("libhccl", "libascend", "libacl", "libge_runner")):
        what = "the Ascend CANN libraries are not found (CANN missing or not sourced)"
    elif "undefined symbol" in error:
        what = "torch_npu was built for another torch version"
    else:
        what = "torch_npu failed to import"
    return f"{what} ({error}); {NPU_INSTALL_HINT.format(torch_version=_torch_version())}"


def import_torchair():
    """Import torchair (it ships inside torch-npu) or raise an error that names the fix.

    After `import torch_npu`, `import torchair` always succeeds: the module is lazy, and a
    broken torchair (no protobuf, no GE library) fails only at its first attribute. Reading
    `get_npu_backend` inside the `try` makes that failure happen here, with this message.
    """
    torch_npu = import_torch_npu()  # names CANN, set_env.sh and the torch-npu version
    try:
        import torchair

        torchair.get_npu_backend  # noqa: B018 (loads the lazy module)
        return torchair
    except (ImportError, AttributeError) as e:
        error = e
    try:  # the copy inside torch_npu, for releases that do not alias it as `torchair`
        from torch_npu.dynamo import torchair

        torchair.get_npu_backend  # noqa: B018
        return torchair
    except (ImportError, AttributeError):
        pass
    version = getattr(torch_npu, "__version__", "?")
    raise RuntimeError(
        f"--enable-torch-compile on npu needs torchair, which ships inside torch-npu {version}, "
        f"but it fails to load ({type(error).__name__}: {error}); torchair also needs protobuf "
        "and packaging (pip install airserve[npu] installs them) and the GE libraries of CANN; "
        f"install torch-npu=={_torch_version()}, or drop --enable-torch-compile to use the NPU "
        "graph runner") from error


def require_openvino():
    """Import openvino or raise one error saying how to install it."""
    try:
        import openvino
    except ImportError as e:
        raise RuntimeError(f"--torch-compile-backend openvino needs the openvino package "
                           f"({e}); {OPENVINO_INSTALL}") from e
    return openvino
