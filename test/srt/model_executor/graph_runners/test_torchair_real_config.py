"""TorchAirRunner's compiler options against torchair's real `CompilerConfig` (torch-npu 2.13.0).

The wheel is downloaded once (`pip download --no-deps`, never installed) into
~/.cache/airserve (or $AIRSERVE_CACHE_DIR) and only torchair's config modules are unpacked.
They import the standard library and torch.distributed only, so they load on CPU without
importing torch_npu: the `torchair` package and its heavy subpackages are stood in for by empty
packages whose path is the unpacked folder. Skipped, with the reason, when the wheel cannot be
fetched (no network, or no wheel for this platform).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from airserve.srt.model_executor.graph_runners.config import RunnerConfig
from airserve.srt.model_executor.graph_runners.torchair.compile import (
    EAGER_SWITCHES,
    build_compiler_config,
    check_not_eager,
    config_summary,
)
from airserve.srt.server_args import ServerArgs

TORCH_NPU = "2.13.0"
TORCHAIR_IN_WHEEL = "torch_npu/dynamo/torchair/"
# What the config modules import from torchair: the configs and two small stdlib-only modules.
NEEDED = ("configs/", "_utils/error_code.py", "core/utils.py")
STUB_PACKAGES = ("torchair", "torchair.configs", "torchair._utils", "torchair.core")


def cache_dir() -> Path:
    root = os.environ.get("AIRSERVE_CACHE_DIR") or os.path.expanduser("~/.cache/airserve")
    return Path(root) / f"torch-npu-{TORCH_NPU}"


def unpacked_torchair() -> Path:
    """The folder holding torchair's config sources from the wheel (downloaded once)."""
    folder = cache_dir()
    target = folder / "torchair"
    if (target / "configs" / "compiler_config.py").exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    wheels = sorted(folder.glob(f"torch_npu-{TORCH_NPU}-*.whl"))
    if not wheels:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             f"torch-npu=={TORCH_NPU}", "-d", str(folder)],
            capture_output=True, text=True, timeout=600)
        wheels = sorted(folder.glob(f"torch_npu-{TORCH_NPU}-*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"cannot fetch the torch-npu {TORCH_NPU} wheel ({last})")
    with zipfile.ZipFile(wheels[0]) as wheel:
        for name in wheel.namelist():
            inner = name[len(TORCHAIR_IN_WHEEL):]
            if name.startswith(TORCHAIR_IN_WHEEL) and inner.startswith(NEEDED) \
                    and not name.endswith("/"):
                out = target / inner
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(wheel.read(name))
    return target


@pytest.fixture(scope="module")
def compiler_config_class():
    """torchair's CompilerConfig class; sys.modules is restored afterwards."""
    root = unpacked_torchair()
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in ("torchair", "torch_npu")}
    for name in STUB_PACKAGES:
        package = types.ModuleType(name)
        sub = name.split(".")[1:]
        package.__path__ = [str(root.joinpath(*sub))]
        sys.modules[name] = package
    try:
        from torchair.configs.compiler_config import CompilerConfig

        assert "torch_npu" not in sys.modules
        yield CompilerConfig
    finally:
        for name in [k for k in sys.modules if k.split(".")[0] == "torchair"]:
            del sys.modules[name]
        sys.modules.update(saved)


def runner_config(**kw) -> RunnerConfig:
    return RunnerConfig.from_server_args(ServerArgs(device="npu", enable_torch_compile=True,
                                                    **kw))


def leaf(cfg, path: str):
    node = cfg
    for name in path.split("."):
        node = getattr(node, name)  # AttributeError: the path does not exist in torchair
    return node.value


def test_every_path_airserve_reads_exists_with_the_expected_default(compiler_config_class):
    cfg = compiler_config_class()
    for path in config_summary(cfg):
        leaf(cfg, path)
    for path, wanted in EAGER_SWITCHES.items():
        assert leaf(cfg, path) == wanted, path
    check_not_eager(cfg)


@pytest.mark.parametrize("kw, expected", [
    ({}, {"mode": "max-autotune", "experimental_config.frozen_parameter": "1",
          "experimental_config.keep_inference_input_mutations": "1",
          "experimental_config.tiling_schedule_optimize": "0"}),
    (dict(torchair_tiling_schedule_optimize=True, torchair_frozen_parameter=False),
     {"mode": "max-autotune", "experimental_config.frozen_parameter": "0",
      "experimental_config.tiling_schedule_optimize": "1"}),
    # 2.13.0 takes npugraph_ex itself: no fallback to reduce-overhead.
    (dict(torchair_mode="npugraph_ex"),
     {"mode": "npugraph_ex", "debug.aclgraph.static_capture_size_limit": "64"}),
    (dict(torchair_mode="reduce-overhead"),
     {"mode": "reduce-overhead", "debug.aclgraph.static_capture_size_limit": "64"}),
])
def test_flags_land_in_the_real_config(compiler_config_class, kw, expected):
    cfg = build_compiler_config(compiler_config_class(), runner_config(**kw), num_buckets=5)
    for path, value in expected.items():
        assert leaf(cfg, path) == value, path
    assert config_summary(cfg) == {p: leaf(cfg, p) for p in config_summary(cfg)}
    cfg.as_dict()  # what get_npu_backend reads: every value must pass torchair's own checks


def test_capture_limit_above_the_bucket_count(compiler_config_class):
    cfg = build_compiler_config(compiler_config_class(),
                                runner_config(torchair_mode="npugraph_ex"), num_buckets=100)
    assert leaf(cfg, "debug.aclgraph.static_capture_size_limit") == "101"


@pytest.mark.parametrize("path, value", [("debug.run_eagerly", True),
                                         ("debug.fx_summary.type", "csv"),
                                         ("debug.data_dump.type", "npy")])
def test_real_eager_switches_are_refused(compiler_config_class, path, value):
    cfg = compiler_config_class()
    *parents, name = path.split(".")
    node = cfg
    for p in parents:
        node = getattr(node, p)
    setattr(node, name, value)
    with pytest.raises(RuntimeError, match="eagerly"):
        check_not_eager(cfg)
