"""The compile-cache key and folders of TorchAirRunner (`--torchair-cache-dir`), on CPU."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest
import torch

from airserve.srt.model_executor.graph_runners.base import GraphCaptureError
from airserve.srt.model_executor.graph_runners.torchair.cache import (
    KEY_FILE,
    CompileCacheKey,
    cann_version,
    open_bucket_cache,
)
from airserve.srt.model_executor.graph_runners.torchair.compile import CompileBackend
from airserve.srt.model_executor.graph_runners.torchair.runner import TorchAirRunner
from airserve_testing.decode_driver import make_runner

KEY = CompileCacheKey(
    bucket=4, kv_shape=(2048, 2, 16), kv_dtype="torch.bfloat16", num_layers=2, page_size=128,
    max_blocks=4, model_path="/models/a", model_config_hash="c0ffee", code_hash="abc",
    mode="max-autotune", compiler_options="[]", torch="2.13.0", torch_npu="2.13.0",
    cann="8.3.RC1")


def test_same_key_reuses_the_folder(tmp_path, caplog):
    folder = open_bucket_cache(str(tmp_path), KEY)
    assert folder == str(tmp_path / "decode_bs4")
    (tmp_path / "decode_bs4" / "compiled_module").write_text("graph")
    with caplog.at_level(logging.INFO):
        assert open_bucket_cache(str(tmp_path), KEY) == folder
    assert (tmp_path / "decode_bs4" / "compiled_module").exists()
    assert "reusing" in caplog.text and "stale" not in caplog.text
    with open(os.path.join(folder, KEY_FILE)) as f:
        assert json.load(f)["kv_shape"] == [2048, 2, 16]


@pytest.mark.parametrize("change", [
    {"kv_shape": (4096, 2, 16)}, {"kv_dtype": "torch.float16"}, {"model_path": "/models/b"},
    {"model_config_hash": "beef"}, {"code_hash": "def"}, {"mode": "reduce-overhead"},
    {"torch": "2.14.0"}, {"torch_npu": "2.13.0.post1"}, {"cann": "8.5.0"}, {"page_size": 256},
])
def test_any_change_deletes_the_stale_graph_with_a_log_line(tmp_path, caplog, change):
    open_bucket_cache(str(tmp_path), KEY)
    (tmp_path / "decode_bs4" / "compiled_module").write_text("graph")
    new = dataclasses.replace(KEY, **change)
    with caplog.at_level(logging.WARNING):
        folder = open_bucket_cache(str(tmp_path), new)
    assert not (tmp_path / "decode_bs4" / "compiled_module").exists()
    field = next(iter(change))
    assert "stale" in caplog.text and field in caplog.text
    with open(os.path.join(folder, KEY_FILE)) as f:
        assert json.load(f) == new.as_dict()


def test_buckets_get_separate_folders(tmp_path):
    a = open_bucket_cache(str(tmp_path), KEY)
    b = open_bucket_cache(str(tmp_path), dataclasses.replace(KEY, bucket=8))
    assert a != b and os.path.isdir(a) and os.path.isdir(b)


def test_unreadable_key_file_is_stale(tmp_path, caplog):
    folder = tmp_path / "decode_bs4"
    folder.mkdir()
    (folder / KEY_FILE).write_text("{not json")
    (folder / "compiled_module").write_text("graph")
    with caplog.at_level(logging.WARNING):
        open_bucket_cache(str(tmp_path), KEY)
    assert not (folder / "compiled_module").exists() and "stale" in caplog.text


def test_cann_version_from_the_toolkit_install_info(tmp_path):
    import platform

    info = tmp_path / f"{platform.machine() or 'x86_64'}-linux"
    info.mkdir()
    (info / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=8.3.RC1\ninnerversion=V100R001C23\n")
    assert cann_version({"ASCEND_TOOLKIT_HOME": str(tmp_path)}) == "8.3.RC1"
    assert cann_version({}) == "unknown"


# The runner with a cache-capable backend: torchair's cache_compile replaced by a recorder.
def recording_cache_backend(calls: list) -> CompileBackend:
    def backend(gm, example_inputs):
        return gm.forward

    def cache_compile(method, folder):
        calls.append((method.__name__, method.__self__, folder))
        return torch.compile(method, backend=backend, fullgraph=True, dynamic=True)

    return CompileBackend(name="fake torchair", backend=backend, cache_compile=cache_compile,
                          mode="max-autotune", options={"frozen_parameter": "1"})


def runner_with_cache(model_path, cache_dir, calls, page_size=16):
    mr = make_runner(model_path, page_size=page_size, torch_compile_max_bs=4,
                     cuda_graph_bs=(1, 4), torchair_cache_dir=str(cache_dir))
    mr.graph_runner = TorchAirRunner(mr, compile_backend=recording_cache_backend(calls))
    return mr


def test_runner_compiles_each_bucket_through_the_cache_under_its_own_name(
        tiny_llama_dir, tmp_path, caplog):
    calls = []
    mr = runner_with_cache(tiny_llama_dir, tmp_path, calls)
    names = sorted(name for name, _, _ in calls)
    assert names == ["decode_bs1", "decode_bs4"]
    assert len({id(step) for _, step, _ in calls}) == 1  # one module, one method per bucket
    for name, _, folder in calls:
        assert folder == str(tmp_path / name) and os.path.exists(os.path.join(folder, KEY_FILE))
    key = mr.graph_runner.cache_key(4)
    assert key.kv_shape == tuple(mr.kv_cache.k_buffers[0].shape)
    assert key.model_path == tiny_llama_dir and key.num_layers == 2
    assert key.kv_dtype == "torch.float32" and key.torch == torch.__version__
    assert key.max_blocks == -(-mr.context_len // 16)

    # Same configuration: reused. Another page size (KV shape): both buckets are stale.
    with caplog.at_level(logging.INFO):
        runner_with_cache(tiny_llama_dir, tmp_path, [])
    assert caplog.text.count("reusing") == 2 and "stale" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        runner_with_cache(tiny_llama_dir, tmp_path, [], page_size=32)
    assert caplog.text.count("stale") == 2 and "page_size" in caplog.text


def test_cache_on_npu_needs_the_cann_version(tiny_llama_dir, tmp_path, monkeypatch):
    mr = runner_with_cache(tiny_llama_dir, tmp_path, [])
    monkeypatch.setattr(mr, "device", "npu")
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    with pytest.raises(GraphCaptureError, match="set_env.sh"):
        mr.graph_runner.cache_key(1)
