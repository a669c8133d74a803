"""W2 side by side: airserve and OpenVINO GenAI serving 64 requests at once, in one run.

W2 = N prompts of L random token ids (seeded, the same ids for every engine), M greedy new
tokens each with `ignore_eos`, all submitted at once. Each configuration runs in a fresh process,
one after another (never two at once on the same cores), with the same thread count:

- `airserve:<mode>`: the offline Engine (`eager`, `compile` = CPU graph runner, `openvino`);
  `airserve:<mode>+<path>` sets the matmul path of prefill and large batches (`float32`,
  `bfloat16`, `w8a8_int8`, `w8a8_int8_outliers`; without it, `auto` for this CPU);
- `served:<mode>`: `launch_server` in that mode, all requests posted to /generate at once;
- `ov-genai:<fp32|int8>`: OpenVINO GenAI's ContinuousBatchingPipeline on the default model
  exported to IR (`bash scripts/setup_ov_genai.sh` makes the venv and the export; pass its python
  with --ov-python and the export directory with --ov-models); `ov-llm:<...>`: its one-stream
  `LLMPipeline` (one prompt: bench_w1.py);

Per configuration: output tok/s over the W2 wall time, wall time, median TTFT of a lone 32-token
prompt (a 1-token generation, after warm-up), peak RSS (the engine's whole process tree,
sampled from outside every 0.2 s from its start, load included; the same measure for every
engine), and the share of requests whose greedy ids equal the first configuration's. Prints a
table (ratios against the best OpenVINO GenAI configuration) and writes JSON.

`--rounds N` runs the whole list N times over. On a machine whose speed drifts between
minutes (a shared VM) a ratio is then taken within each round, against the OpenVINO GenAI runs
of that round, and the summary gives each configuration's median tok/s and median ratio.

    python benchmark/throughput/bench_w2.py --ov-python .venv-ovgenai/bin/python \
        --ov-models ~/.cache/airserve/ov_genai --output w2.json
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runners"))

from airserve.srt.hardware import host_cpu  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "eager": {},
    "compile": {"enable_torch_compile": True},
    "openvino": {"enable_torch_compile": True, "torch_compile_backend": "openvino"},
}
# The flags of each matmul path (layers/quant/matmul_paths.py).
PATH_ARGS: dict[str, dict[str, Any]] = {
    "auto": {},
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "float16_weights": {"quantization": "float16_weights"},
    "w8a8_int8": {"quantization": "w8a8_int8"},
    "w8a8_int8_outliers": {"quantization": "w8a8_int8_outliers"},
    # Not matmul paths: the activations of the packed decode products (default "auto").
    "act-float32": {"cpu_decode_activations": "float32"},
    "act-int8": {"cpu_decode_activations": "int8"},
    "act-int16": {"cpu_decode_activations": "int16"},
    "act-auto": {"cpu_decode_activations": "auto"},
    # Nor these: the KV cache's element type (default auto).
    "kv-float32": {"kv_cache_dtype": "float32"},
    "kv-bfloat16": {"kv_cache_dtype": "bfloat16"},
    "kv-float16": {"kv_cache_dtype": "float16"},
    "kv-int8": {"kv_cache_dtype": "int8"},
    # Nor these: the activations of Q4_1 layers above the packed limit and in prefill (default
    # auto: int8 in gate/up and down beside float16_weights; matmul_paths' int8_blocks).
    "large-float": {"cpu_large_activations": "float"},
    "large-int8": {"cpu_large_activations": "int8"},
    "large-auto": {"cpu_large_activations": "auto"},
    # Nor this: KV pages of 16 slots (cpu default 1), so a request's decode tokens sit together.
    "page16": {"page_size": 16},
}
DEFAULT_CONFIGS = ["airserve:eager", "airserve:compile", "served:eager", "ov-genai:fp32",
                   "ov-genai:int8"]


# What the table names beside its figures.
FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16")


def key_values(items: list[str], flag: str) -> dict[str, Any]:
    """A repeatable flag's KEY=VALUE strings as a dict; a value is read as a Python literal when
    it is one (512, 0.8, True, (1, 2)), else kept as the string (auto, a path)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not key or not sep:
            raise SystemExit(f"{flag} takes KEY=VALUE, got {item!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def make_job(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    # Ids away from both ends of the vocabulary (special tokens sit at the start).
    lo, hi = 100, args.vocab_size - 100
    prompts = [[rng.randrange(lo, hi) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    lone = [rng.randrange(lo, hi) for _ in range(32)]
    return {"prompts": prompts, "lone_prompt": lone, "output_len": args.output_len,
            "threads": args.num_threads, "ttft_repeats": args.ttft_repeats}


def server_args_for(mode: str, args: argparse.Namespace, path: str = "auto") -> dict:
    """Engine arguments of `mode` with the PATH_ARGS of `path` ("+"-joined names combine)."""
    kwargs = dict(MODES[mode])
    for name in path.split("+"):
        kwargs.update(PATH_ARGS[name])
    kwargs["num_threads"] = args.num_threads
    kwargs["max_running_requests"] = args.num_prompts
    if getattr(args, "model_path", None):  # bench_w1 --gguf-type: another GGUF of the model
        kwargs["model_path"] = args.model_path
    if kwargs.get("enable_torch_compile"):
        kwargs["cuda_graph_bs"] = tuple(args.graph_bs)
    kwargs.update(key_values(getattr(args, "server_arg", None) or [], "--server-arg"))
    return kwargs


# ---- airserve, offline (runs in a child process: --worker airserve) -------------------------

def run_airserve_offline(job: dict) -> dict:
    import airserve

    t0 = time.perf_counter()
    engine = airserve.Engine(**job["server_args"])
    load_s = time.perf_counter() - t0
    greedy = {"temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=job["lone_prompt"], sampling_params=dict(greedy, max_new_tokens=8))
    ttft = []
    for _ in range(job["ttft_repeats"]):
        t = time.perf_counter()
        engine.generate(input_ids=job["lone_prompt"],
                        sampling_params=dict(greedy, max_new_tokens=1))
        ttft.append(time.perf_counter() - t)
    params = dict(greedy, max_new_tokens=job["output_len"])
    t = time.perf_counter()
    outs = engine.generate(input_ids=job["prompts"], sampling_params=params)
    wall = time.perf_counter() - t
    info = engine.get_server_info()
    return {"load_s": load_s, "wall_s": wall,
            "output_tokens": sum(len(o["output_ids"]) for o in outs),
            "ttft_lone_ms": 1000 * statistics.median(ttft),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "output_ids": [o["output_ids"] for o in outs],
            "runner": (info.get("graph_runner") or {}).get("runner", "eager"),
            "eager_fallbacks": info.get("eager_fallbacks")}


# ---- airserve, served --------------------------------------------------------------------

def _flags(kwargs: dict) -> list[str]:
    flags: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif isinstance(value, (tuple, list)):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def _post_all(url: str, payloads: list[dict]) -> list[dict]:
    import asyncio

    import aiohttp

    async def go() -> list[dict]:
        timeout = aiohttp.ClientTimeout(total=3600)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async def one(p: dict) -> dict:
                async with s.post(url + "/generate", json=p) as r:
                    body = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {body}")
                    return body
            return await asyncio.gather(*(one(p) for p in payloads))

    return asyncio.run(go())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_served(mode: str, job: dict, args: argparse.Namespace, log_dir: Path) -> dict:
    from compare_runners import PeakRss, Server

    server = Server(_flags(job["server_args"]), _free_port(), log_dir / f"server_{mode}.log")
    with server:
        rss = PeakRss(server.proc.pid)  # from spawn, as for the offline workers: load included
        load_s = server.wait_ready(args.startup_timeout)
        greedy = {"temperature": 0.0, "ignore_eos": True}
        lone = {"input_ids": job["lone_prompt"], "sampling_params": dict(greedy, max_new_tokens=1)}
        _post_all(server.url, [dict(lone, sampling_params=dict(greedy, max_new_tokens=8))])
        ttft = []
        for _ in range(job["ttft_repeats"]):
            t = time.perf_counter()
            _post_all(server.url, [lone])
            ttft.append(time.perf_counter() - t)
        params = dict(greedy, max_new_tokens=job["output_len"])
        t = time.perf_counter()
        outs = _post_all(server.url, [{"input_ids": p, "sampling_params": params}
                                      for p in job["prompts"]])
        wall = time.perf_counter() - t
        peak = rss.stop()
    return {"load_s": load_s, "wall_s": wall,
            "output_tokens": sum(len(o["output_ids"]) for o in outs),
            "ttft_lone_ms": 1000 * statistics.median(ttft), "peak_rss_mb": peak,
            "output_ids": [o["output_ids"] for o in outs]}


# ---- driver -------------------------------------------------------------------------------

def run_child(cmd: list[str], job: dict, tmp: Path, name: str, timeout: float) -> dict:
    """Run one worker process on `job`; its result gains `peak_rss_mb`, the peak RSS of the
    worker and its children sampled from outside (the same measure for every engine)."""
    from compare_runners import PeakRss

    job_file, out_file = tmp / f"{name}.job.json", tmp / f"{name}.out.json"
    log_file = tmp / f"{name}.log"
    job_file.write_text(json.dumps(job))
    with open(log_file, "w") as log:
        proc = subprocess.Popen([*cmd, str(job_file), str(out_file)], stdout=log,
                                stderr=subprocess.STDOUT, text=True)
        rss = PeakRss(proc.pid)
        try:
            proc.wait(timeout=timeout)
        finally:
            peak = rss.stop()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0 or not out_file.exists():
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")
    result = json.loads(out_file.read_text())
    # The worker's own figure (getrusage: this process only, not its compile workers).
    result["peak_rss_self_mb"] = result.pop("peak_rss_mb", None)
    result["peak_rss_mb"] = peak
    return result


def run_config(config: str, base_job: dict, args: argparse.Namespace, tmp: Path) -> dict:
    kind, _, variant = config.partition(":")
    job = dict(base_job)
    name = config.replace(":", "_").replace("+", "_")
    if kind in ("ov-genai", "ov-llm"):
        if not args.ov_python:
            raise RuntimeError("--ov-python is not set (bash scripts/setup_ov_genai.sh)")
        job.update(model_dir=str(Path(args.ov_models).expanduser() / variant),
                   max_num_batched_tokens=args.ov_max_num_batched_tokens,
                   kv_cache_gb=args.ov_kv_cache_gb, precision=args.ov_precision,
                   pipeline="llm" if kind == "ov-llm" else "continuous_batching")
        worker = str(Path(__file__).with_name("ov_genai_worker.py"))
        return run_child([args.ov_python, worker], job, tmp, name, args.timeout)
    variant, _, path = variant.partition("+")
    if variant not in MODES:
        raise RuntimeError(f"unknown airserve mode {variant!r}; choose from {sorted(MODES)}")
    unknown = [p for p in path.split("+") if p not in PATH_ARGS] if path else []
    if unknown:
        raise RuntimeError(f"unknown matmul path {unknown[0]!r}; choose from {sorted(PATH_ARGS)}")
    job["server_args"] = server_args_for(variant, args, path or "auto")
    if kind == "airserve":
        cmd = [sys.executable, __file__, "--worker"]
        return run_child(cmd, job, tmp, name, args.timeout)
    if kind == "served":
        return run_served(variant, job, args, tmp)
    raise RuntimeError(f"unknown configuration kind {kind!r} (airserve, served, ov-genai, "
                       "ov-llm)")


def same_share(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


def round_ratios(rows: list[dict]) -> dict[str, list[float]]:
    """Per configuration, its tok/s over the best OpenVINO GenAI tok/s of the same round."""
    ratios: dict[str, list[float]] = {}
    for rnd in sorted({r.get("round", 0) for r in rows}):
        same = [r for r in rows if r.get("round", 0) == rnd and "wall_s" in r]
        ov = max((r["output_tok_s"] for r in same if r["config"].startswith("ov-genai")),
                 default=None)
        for r in same:
            if ov:
                ratios.setdefault(r["config"], []).append(r["output_tok_s"] / ov)
    return ratios


def print_summary(rows: list[dict]) -> dict[str, dict]:
    """Median tok/s and median same-round ratio per configuration; returns them."""
    ratios = round_ratios(rows)
    summary = {}
    print("\n| config | rounds | median output tok/s | median ratio vs OV GenAI, same round | "
          "ratios |")
    print("|---" * 5 + "|")
    for config in dict.fromkeys(r["config"] for r in rows):
        tps = [r["output_tok_s"] for r in rows if r["config"] == config and "wall_s" in r]
        if not tps:
            continue
        rs = ratios.get(config, [])
        summary[config] = {"rounds": len(tps), "median_output_tok_s": statistics.median(tps),
                           "median_ratio": statistics.median(rs) if rs else None,
                           "ratios": rs}
        med = f"{statistics.median(rs):.2f}x" if rs else "-"
        print(f"| {config} | {len(tps)} | {statistics.median(tps):.1f} | {med} | "
              f"{' '.join(f'{x:.2f}' for x in rs)} |")
    return summary


def print_table(rows: list[dict], cpu: str) -> None:
    ov = [r for r in rows if r["config"].startswith("ov-genai") and "wall_s" in r]
    best = max((r["output_tok_s"] for r in ov), default=None)
    print(f"\nW2 on {cpu}")
    head = ("| config | output tok/s | vs best OV GenAI | wall (s) | TTFT lone 32 (ms) | "
            "peak RSS (MiB) | same greedy ids as first |")
    print(head)
    print("|---" * 7 + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | failed: {r['error'].splitlines()[0][:80]} |||||| ")
            continue
        ratio = f"{r['output_tok_s'] / best:.2f}x" if best else "-"
        rss = f"{r['peak_rss_mb']:.0f}" if r.get("peak_rss_mb") else "-"
        print(f"| {r['config']} | {r['output_tok_s']:.1f} | {ratio} | {r['wall_s']:.1f} | "
              f"{r['ttft_lone_ms']:.0f} | {rss} | {r['same_ids']:.2f} |")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the configurations this many times over (ratios per round)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--graph-bs", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                   help="decode batch sizes the graph runners capture")
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-repeats", type=int, default=5)
    p.add_argument("--ov-python", default=None, help="python of the OpenVINO GenAI venv")
    p.add_argument("--ov-models", default="~/.cache/airserve/ov_genai")
    p.add_argument("--ov-max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--ov-kv-cache-gb", type=int, default=2)
    p.add_argument("--ov-precision", default=None, help="INFERENCE_PRECISION_HINT (default: "
                   "OpenVINO's own choice for this CPU)")
    p.add_argument("--server-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a ServerArgs field for every airserve configuration (offline and "
                        "served), e.g. openvino_static_kv_len=512; repeatable")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--timeout", type=float, default=3600, help="per configuration, seconds")
    p.add_argument("--output", default="w2_results.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        job = json.loads(Path(argv[1]).read_text())
        Path(argv[2]).write_text(json.dumps(run_airserve_offline(job)))
        return 0
    args = build_parser().parse_args(argv)
    cpu, flags = host_cpu()
    base_job = make_job(args)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_w2_") as tmp_name:
        tmp = Path(tmp_name)
        for rnd, config in ((r, c) for r in range(args.rounds) for c in args.configs):
            print(f"== {config}" + (f" (round {rnd + 1})" if args.rounds > 1 else ""),
                  flush=True)
            row: dict[str, Any] = {"config": config, "round": rnd}
            try:
                row.update(run_config(config, base_job, args, tmp))
                row["output_tok_s"] = row["output_tokens"] / row["wall_s"]
                first = next((r for r in rows if "output_ids" in r), row)
                row["same_ids"] = same_share(row["output_ids"], first["output_ids"])
                print(f"   {row['output_tok_s']:.1f} output tok/s, wall {row['wall_s']:.1f} s",
                      flush=True)
            except Exception as e:  # one configuration failing must not lose the others
                row["error"] = str(e)
                print(f"   failed: {e}", flush=True)
            rows.append(row)
    print_table(rows, cpu)
    summary = print_summary(rows) if args.rounds > 1 else None
    workload = {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len",
                                              "num_threads", "rounds")}
    result = {"summary": summary, "workload": workload,
              "cpu": cpu, "cpu_features": [f for f in FEATURES if f in flags],
              "torch_threads": args.num_threads,
              "rows": [{k: v for k, v in r.items() if k != "output_ids"} for r in rows]}
    Path(args.output).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.output}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
