"""CPUGraphRunner's stored buckets (--compile-cache-dir): a restart loads, never recompiles.

Each start runs in a fresh process (airserve_testing.compiled_start: two buckets of a tiny llama
sharing one compiled graph, greedy tokens from the compiled runner and from eager on the same
model). Loaded vs compiled is read from the runner's own report, not from timing. Two compiles
in all: the cold start and the rebuild of a corrupted graph.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from airserve.srt.model_executor.graph_runners.bucket_store import (
    StaleBucket,
    TensorIndex,
    file_sha256,
)
from airserve.srt.model_executor.graph_runners.config import RunnerConfig
from airserve.srt.model_executor.graph_runners.cpu import (
    SERIAL_COMPILE_MAX_CORES,
    CPUGraphRunner,
    compile_threads,
)
from airserve.srt.server_args import ServerArgs

BUCKETS = (2, 3)  # one graph, batch dimension dynamic
BUCKET = BUCKETS[0]


def start(model_dir: str, cache_dir: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(root), "python"), root,
                                         env.get("PYTHONPATH", "")])
    buckets = ",".join(map(str, BUCKETS))
    out = subprocess.run([sys.executable, "-m", "airserve_testing.compiled_start", model_dir,
                          cache_dir, buckets], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def starts(tiny_llama_dir, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("compile-cache"))
    cold = start(tiny_llama_dir, cache)
    warm = start(tiny_llama_dir, cache)
    return cache, cold, warm


def test_warm_start_loads_and_matches_cold_and_eager(starts):
    _, cold, warm = starts
    assert cold["report"]["buckets_compiled"] == list(BUCKETS)
    assert cold["report"]["graphs_compiled"] == 1  # the buckets share one graph
    assert cold["report"]["buckets_loaded"] == []
    assert "unstored_buckets" not in cold["report"]
    graphs = [f for f in os.listdir(cold["store_dir"]) if f.endswith(".bin")]
    assert len(graphs) == 1  # stored once
    assert warm["report"]["buckets_loaded"] == list(BUCKETS)
    assert warm["report"]["graphs_loaded"] == 1
    assert warm["report"]["buckets_compiled"] == []  # no dynamo trace, no inductor compile
    assert warm["report"]["graphs_compiled"] == 0
    # Nor a C++ build: the stored graph's wrapper and kernels are found under the options they
    # were built with (loaded under others, inductor built the wrapper again). Inductor still
    # preprocesses its precompiled header's source to name it (header.hpp, ~0.3 s).
    builds = [c for c in warm["compiler_runs"] if not c.endswith("header.hpp")]
    assert cold["compiler_runs"] or cold["compile_workers"] > 0
    assert builds == [], warm["compiler_runs"]
    assert "stale_buckets" not in warm["report"]
    assert warm["report"]["direct_replay_buckets"] == list(BUCKETS)
    assert warm["replays"] == cold["replays"] > 0  # the decode steps ran in the graph
    assert warm["graph"] == cold["graph"] == cold["eager"] == warm["eager"]


@pytest.mark.skipif((os.cpu_count() or 0) > SERIAL_COMPILE_MAX_CORES
                    or "TORCHINDUCTOR_COMPILE_THREADS" in os.environ,
                    reason="inductor's own compile threads apply on this machine")
def test_cold_start_compiles_without_a_worker_pool_on_few_cores(tiny_llama_dir, tmp_path,
                                                               monkeypatch):
    """Without a store (a server's default) dynamo's inductor backend starts inductor's pool of
    compile workers unless compile_threads is 1 (~820 MiB more at the default model's cold start
    on 2 cores, benchmark/runners/startup.py)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # cold: nothing cached
    cold = start(tiny_llama_dir, "none")
    assert cold["report"]["compile_threads"] == 1
    assert cold["report"]["graphs_compiled"] == 1  # it did compile, in this process
    assert cold["compile_workers"] == 0  # inductor's default started a sidecar and workers
    assert cold["graph"] == cold["eager"]


def test_compile_threads_rule():
    assert compile_threads(2, {}) == 1
    assert compile_threads(SERIAL_COMPILE_MAX_CORES, {}) == 1
    assert compile_threads(SERIAL_COMPILE_MAX_CORES + 1, {}) is None
    assert compile_threads(2, {"TORCHINDUCTOR_COMPILE_THREADS": "2"}) is None  # the user's
    assert compile_threads(None, {}) is None


def test_corrupted_bucket_is_detected_and_rebuilt(starts, tiny_llama_dir):
    cache, _, warm = starts
    with open(os.path.join(warm["store_dir"], f"bs{BUCKET}.json")) as f:
        artifact = os.path.join(warm["store_dir"], json.load(f)["artifact"])
    with open(artifact, "r+b") as f:  # one flipped byte in the middle
        f.seek(os.path.getsize(artifact) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    rebuilt = start(tiny_llama_dir, cache)
    report = rebuilt["report"]
    # The largest bucket is captured first: it finds the corrupted graph and compiles it again.
    assert "checksum" in report["stale_buckets"][str(BUCKETS[-1])]
    assert report["graphs_compiled"] == 1
    assert BUCKETS[-1] in report["buckets_compiled"]
    assert sorted(report["buckets_compiled"] + report["buckets_loaded"]) == list(BUCKETS)
    assert rebuilt["graph"] == rebuilt["eager"] == warm["graph"]
    for bs in BUCKETS:  # stored again, intact
        with open(os.path.join(warm["store_dir"], f"bs{bs}.json")) as f:
            manifest = json.load(f)
        stored = os.path.join(warm["store_dir"], manifest["artifact"])
        assert manifest["sha256"] == file_sha256(stored)


def store_dir(model_dir: str, cache: str, **flags) -> str:
    """Where a runner started as compiled_start starts it, with `flags` changed, keeps its
    buckets (nothing compiles)."""
    flags = {"cuda_graph_bs": BUCKETS, "dtype": "float32", **flags}  # make_runner's dtype
    args = ServerArgs(model_path=model_dir, max_total_tokens=2048, max_running_requests=8,
                      enable_torch_compile=True, compile_cache_dir=cache, **flags)
    return CPUGraphRunner.open_store(RunnerConfig.from_server_args(args), 0, 8).dir


def test_changed_flag_or_model_uses_another_store(starts, tiny_llama_dir, tiny_qwen2_dir,
                                                 monkeypatch):
    cache, _, warm = starts
    assert store_dir(tiny_llama_dir, cache) == warm["store_dir"]  # same flags: same store
    assert store_dir(tiny_llama_dir, cache, page_size=16) != warm["store_dir"]
    assert store_dir(tiny_llama_dir, cache, num_threads=1) != warm["store_dir"]
    assert store_dir(tiny_llama_dir, cache, cuda_graph_bs=(1, *BUCKETS)) != warm["store_dir"]
    assert store_dir(tiny_llama_dir, cache, context_length=256) != warm["store_dir"]
    assert store_dir(tiny_qwen2_dir, cache) != warm["store_dir"]
    # Other C++ operator sources (another build of the kernels) are another store.
    from airserve.srt.layers import cpu_kernels

    real = cpu_kernels.build_name()
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "build_name", lambda: real + "-edited")
        assert store_dir(tiny_llama_dir, cache) != warm["store_dir"]
    # The same path with a rewritten weight file (new mtime) is another model.
    weights = [f for f in os.listdir(tiny_llama_dir) if f.endswith(".safetensors")]
    path = os.path.join(tiny_llama_dir, weights[0])
    stat = os.stat(path)
    try:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        assert store_dir(tiny_llama_dir, cache) != warm["store_dir"]
    finally:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_input_of_another_size_or_name_is_stale():
    """A stored graph's input is rebuilt only from a tensor of the same name, dtype and shape:
    a KV pool of another size would otherwise give the graph a prefix of the new pool."""
    pool = torch.zeros(10, 4)
    spec = TensorIndex({"kv": SimpleNamespace(k_buffers=[pool])}).describe(pool[2:5])
    assert spec["name"] == "kv.k_buffers.0" and spec["offset"] == 8
    view = TensorIndex({"kv": SimpleNamespace(k_buffers=[torch.ones(10, 4)])}).rebuild(spec)
    assert view.shape == (3, 4) and view.sum() == 12
    with pytest.raises(StaleBucket, match="stored graph's is"):
        TensorIndex({"kv": SimpleNamespace(k_buffers=[torch.zeros(20, 4)])}).rebuild(spec)
    with pytest.raises(StaleBucket, match="no tensor kv.k_buffers.0"):
        TensorIndex({"kv": SimpleNamespace(k_buffers=[])}).rebuild(spec)
    with pytest.raises(KeyError):
        TensorIndex({"kv": SimpleNamespace(k_buffers=[])}).describe(pool)


def test_other_weight_handles_make_the_bucket_stale(tmp_path):
    """Reordered (oneDNN) weights reach a graph as integer handles baked into its code: a
    process that numbered its layers otherwise must not replay the stored graph."""
    from airserve.srt.layers.linear import Linear
    from airserve.srt.model_executor.graph_runners.bucket_store import BucketStore

    layer = Linear(16, 8, bias=False)
    layer.set_large_path("float32", float32_impl="onednn")
    index = TensorIndex({"model": layer})
    assert index.handles == {"model..weight_onednn": layer.weight_onednn.handle}
    store = BucketStore(str(tmp_path), {"test": 1})
    art_path = os.path.join(store.dir, "graph-x.bin")
    with open(art_path, "wb") as f:
        f.write(b"not an artifact")

    def manifest(handles: dict, forms: dict | None = None) -> None:
        with open(store.manifest_path(1), "w") as f:
            json.dump({"artifact": "graph-x.bin", "inputs": [], "handles": handles,
                       "forms": index.forms if forms is None else forms,
                       "sha256": file_sha256(art_path)}, f)

    manifest({"model..weight_onednn": layer.weight_onednn.handle + 1})
    with pytest.raises(StaleBucket, match="weight handles differ"):
        store.load(1, index)
    manifest(index.handles)  # same handles: past that check, to the artifact itself
    with pytest.raises(StaleBucket, match="artifact does not load"):
        store.load(1, index)


def test_other_decode_activations_make_the_bucket_stale(tmp_path):
    """A graph bakes in each layer's matmul path and its packed products' activations: a
    build whose `auto` resolves them otherwise (same flags, same version) must recompile, not
    replay the stored graph with the old activations."""
    from airserve.srt.layers.linear import Linear
    from airserve.srt.layers.quant import block_matvec, matmul_paths
    from airserve.srt.model_executor.graph_runners.bucket_store import BucketStore
    from airserve_testing.tiny_gguf import random_packed

    if not block_matvec.kernels_available():
        pytest.fail(f"the block kernels did not build: {block_matvec.unavailable_reason()}")
    layer = Linear(64, 48, bias=False)
    layer.attach_packed(random_packed("q4_1", 48, 64), 4, "auto", drop_weight=True)
    layer.packed_role = "o_proj"
    before = TensorIndex({"model": layer})
    other = block_matvec.resolve_activations("auto", "q4_1", "o_proj")  # int16 or float32
    assert before.forms == {"model.": ["float32", 4, [["q4_1", other]], False]}
    layer.set_large_int8(True)  # int8_blocks for its large batches: another graph
    assert TensorIndex({"model": layer}).forms == {"model.": ["float32", 4, [["q4_1", other]],
                                                            True]}
    layer.set_large_int8(False)
    store = BucketStore(str(tmp_path), {"test": 1})
    art_path = os.path.join(store.dir, "graph-x.bin")
    with open(art_path, "wb") as f:
        f.write(b"not an artifact")
    with open(store.manifest_path(1), "w") as f:
        json.dump({"artifact": "graph-x.bin", "inputs": [], "handles": before.handles,
                   "forms": before.forms, "sha256": file_sha256(art_path)}, f)
    with pytest.raises(StaleBucket, match="artifact does not load"):  # same forms: to the load
        store.load(1, before)
    layer.packed_role = "gate_up_proj"  # auto takes int8 for q4_1 there
    after = TensorIndex({"model": layer})
    assert after.forms == {"model.": ["float32", 4, [["q4_1", "int8"]], False]}
    with pytest.raises(StaleBucket, match="decode activations differ"):
        store.load(1, after)
    layer.packed_role = "o_proj"
    if matmul_paths.int8_available():  # fbgemm: the float16_weights path
        layer.set_large_path("float16_weights")
        fp16 = TensorIndex({"model": layer})
        with open(store.manifest_path(1), "w") as f:  # its handles, the float32 path's forms
            json.dump({"artifact": "graph-x.bin", "inputs": [], "handles": fp16.handles,
                       "forms": before.forms, "sha256": file_sha256(art_path)}, f)
        with pytest.raises(StaleBucket, match="matmul paths"):
            store.load(1, fp16)
