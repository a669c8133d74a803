"""Which decode graph runner a configuration gets (DESIGN.md device table), and device checks.

`select_runner_name` is a pure function of the arguments; `create_graph_runner` imports the
chosen runner on first use, so `import airserve` never imports torch_npu, torchair or openvino.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch

from airserve.srt.server_args import ServerArgs

if TYPE_CHECKING:
    from airserve.srt.model_executor.graph_runner import GraphRunner
    from airserve.srt.model_executor.model_runner import ModelRunner

# Runner name -> (module, class), imported lazily.
RUNNERS = {
    "cpu_graph": ("airserve.srt.model_executor.cpu_graph_runner", "CPUGraphRunner"),
    "openvino": ("airserve.srt.model_executor.openvino_runner", "OpenVINORunner"),
    "cuda_graph": ("airserve.srt.model_executor.cuda_graph_runner", "CudaGraphRunner"),
    "npu_graph": ("airserve.srt.model_executor.npu_graph_runner", "NPUGraphRunner"),
    "torchair": ("airserve.srt.model_executor.torchair_runner", "TorchAirRunner"),
}

NPU_INSTALL_HINT = (
    "install torch-npu=={torch_version} (it must match torch's version), install Ascend CANN "
    "and source its set_env.sh (e.g. `source /usr/local/Ascend/ascend-toolkit/set_env.sh`) "
    "before starting; to use other devices on a host with torch-npu but no CANN, set "
    "TORCH_DEVICE_BACKEND_AUTOLOAD=0"
)


def select_runner_name(args: ServerArgs) -> str | None:
    """The runner for `args` (a key of RUNNERS), or None for eager decode."""
    backend = args.resolved_compile_backend
    if args.device == "cpu":
        if not args.enable_torch_compile:
            return None
        if backend == "openvino":
            return "openvino"
        if backend in ("inductor", "eager"):
            return "cpu_graph"
        raise ValueError(f"--torch-compile-backend {backend} does not run on cpu; "
                         "use inductor or openvino")
    if args.device == "cuda":
        if backend not in ("inductor", "eager"):
            raise ValueError(f"--torch-compile-backend {backend} does not run on cuda; "
                             "use inductor")
        # torch.compile on cuda only runs inside the captured graphs, as in SGLang.
        return None if args.disable_cuda_graph else "cuda_graph"
    if args.enable_torch_compile:  # npu
        if backend != "torchair":
            raise ValueError(f"--torch-compile-backend {backend} does not run on npu; "
                             "use torchair (the default there)")
        return "torchair"
    return None if args.disable_cuda_graph else "npu_graph"


def create_graph_runner(model_runner: ModelRunner) -> GraphRunner | None:
    name = select_runner_name(model_runner.server_args)
    if name is None:
        return None
    module_name, class_name = RUNNERS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise RuntimeError(f"the {class_name} runner ({module_name}) is not part of this "
                           "build; drop --enable-torch-compile or choose another "
                           "--torch-compile-backend") from e
    return getattr(module, class_name)(model_runner)


def check_device(args: ServerArgs) -> None:
    """Raise a clear error if the requested device is absent; never switch devices silently."""
    if args.device == "cuda" and not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (a CPU-only build)"
        raise RuntimeError(
            f"--device cuda was requested but torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, built with {built}). Install a CUDA build of torch and check "
            "the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES, or use --device cpu."
        )
    if args.device == "npu":
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
    torch_version = torch.__version__.split("+")[0]
    hint = NPU_INSTALL_HINT.format(torch_version=torch_version)
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
    if npu_version.split(".")[:2] != torch_version.split(".")[:2]:
        raise RuntimeError(f"--device npu: torch-npu {npu_version} does not match torch "
                           f"{torch_version}; {hint}")
    return torch_npu


def torch_npu_import_failure(error: str) -> str:
    """What the error of importing torch_npu (`error`: its message) means, and how to fix it."""
    if any(lib in error for lib in ("libhccl", "libascend", "libacl", "libge_runner")):
        what = "the Ascend CANN libraries are not found (CANN missing or not sourced)"
    elif "undefined symbol" in error:
        what = "torch_npu was built for another torch version"
    else:
        what = "torch_npu failed to import"
    hint = NPU_INSTALL_HINT.format(torch_version=torch.__version__.split("+")[0])
    return f"{what} ({error}); {hint}"
