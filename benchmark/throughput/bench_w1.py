"""W1 side by side: one stream, airserve against llama.cpp on the same GGUF file and threads.

W1 = one prompt of 32 token ids (seeded), 256 greedy new tokens with `ignore_eos`. Per
configuration, in a fresh process each, one after another: the median time of a 1-token
generation of the prompt (TTFT) and the time of the full 256-token generation; decode tok/s =
255 / (full - TTFT). Configurations:

- `airserve:<eager|compile|openvino>` and `served:<mode>`: as in bench_w2.py (offline Engine,
  or `launch_server` with the requests posted to /generate); the graph runners capture bs 1;
- `llama-cpp`: llama-cpp-python (`pip install -e ".[peers]"`; it builds llama.cpp from
  source) on the default model's GGUF, flash attention on, the KV cache reset before every
  generation;
- `ov-llm:<fp32|int8|int4>` / `ov-genai:<...>`: OpenVINO GenAI's own pipelines (`LLMPipeline`,
  its stateful one-stream pipeline, or `ContinuousBatchingPipeline`) on an IR exported from the
  default model (`--ov-python`, `--ov-models`: bench_w2.py; int4 with `export_ov_model.py
  --weight-formats int4`). Not the same file as the others (optimum-intel quantizes the
  dequantized weights its own way), so its ratio says what OpenVINO itself reaches for one
  stream on this CPU, the ceiling of the `airserve:openvino` runner's backend, not a
  like-for-like comparison.

`--gguf-type Q4_K_M` (or Q5_K_M, Q6_K, Q8_0, ...) runs every configuration on another GGUF of
the default model, made once by llama.cpp's own quantizer from the packaged Q4_1 file (so its
values went through Q4_1 first) and kept in --gguf-dir. This model's 576-wide rows are not a
multiple of the K-quants' 256-value superblocks, so llama.cpp stores those tensors in its
fallback types (Q5_0 / Q5_1 / Q8_0) and only the 1536-wide rows in Q4_K / Q6_K: the table
prints the file's mix of types.

Prints a table (ratio against llama.cpp) and writes JSON. On a shared machine run it when the
machine is quiet. `--rounds N` runs the list N times over; each ratio is taken against
llama.cpp's run of the same round, and a summary gives each configuration's medians.

    python benchmark/throughput/bench_w1.py [--configs airserve:compile llama-cpp] [--output F]
        [--gguf-type Q4_K_M] [--gguf-dir DIR] [--rounds 3]
"""

from __future__ import annotations

import collections
import ctypes
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_w2  # noqa: E402

DEFAULT_CONFIGS = ["airserve:eager", "airserve:compile", "served:compile", "llama-cpp"]
# What a llama.cpp worker killed by SIGSEGV prints: on CPUs with AMX the host-native build's
# AMX kernels faulted at their first tile instruction (scripts/install_peers.sh says more).
LLAMA_CRASH_HINT = ("llama.cpp crashed (SIGSEGV). On a CPU with AMX its host-native build's AMX "
                    "kernels are the known cause: `bash scripts/install_peers.sh` checks the "
                    "build and rebuilds it without AMX where it fails.")


def gguf_file(gguf_type: str, directory: str, threads: int) -> str:
    """The default model's GGUF in `gguf_type`: the packaged file for Q4_1, else a file made by
    llama.cpp's quantizer (requantizing the Q4_1 values) and kept in `directory`."""
    from airserve.srt.model_loader.loader import default_model_path

    source = Path(default_model_path())
    if gguf_type == "Q4_1":
        return str(source)
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{gguf_type}", None)
    if ftype is None:
        raise SystemExit(f"--gguf-type {gguf_type}: llama.cpp has no such file type (e.g. "
                         "Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0)")
    out = Path(directory).expanduser() / f"{source.stem.rsplit('.', 1)[0]}.{gguf_type}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = ftype, True, threads
        partial = out.with_suffix(".partial")
        rc = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(),
                                            ctypes.byref(params))
        if rc != 0:
            raise SystemExit(f"llama.cpp could not quantize {source.name} to {gguf_type} "
                             f"(code {rc})")
        partial.rename(out)
    return str(out)


def tensor_types(path: str) -> dict[str, int]:
    """How many of the file's tensors each GGUF type holds."""
    import gguf

    reader = gguf.GGUFReader(path)
    return dict(collections.Counter(t.tensor_type.name for t in reader.tensors).most_common())


def run_llama_cpp(job: dict) -> dict:
    """One stream on llama.cpp: TTFT of a 1-token generation, then the full generation."""
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=job["model_path"], n_threads=job["threads"],
                          n_threads_batch=job["threads"], n_ctx=512, flash_attn=True,
                          verbose=False)
    load_s = time.perf_counter() - t0

    def generate(n: int) -> tuple[float, list[int]]:
        llm.reset()
        out: list[int] = []
        t = time.perf_counter()
        for tok in llm.generate(job["lone_prompt"], top_k=1, temp=0.0, reset=True):
            out.append(int(tok))
            if len(out) == n:
                break
        return time.perf_counter() - t, out

    generate(8)
    ttft = statistics.median(generate(1)[0] for _ in range(job["ttft_repeats"]))
    wall, ids = generate(job["output_len"])
    return {"load_s": load_s, "wall_s": wall, "output_tokens": len(ids),
            "ttft_lone_ms": 1000 * ttft, "output_ids": [ids],
            "llama_cpp_version": llama_cpp.__version__}


def run_config(config: str, job: dict, args, tmp: Path) -> dict:
    if config == "llama-cpp":
        try:
            return bench_w2.run_child([sys.executable, __file__, "--llama-worker"], job, tmp,
                                      "llama_cpp", args.timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{LLAMA_CRASH_HINT}" if "exited with -11" in str(e)
                               else str(e)) from None
    return bench_w2.run_config(config, job, args, tmp)


def llama_cpp_ratio(row: dict, rows: list[dict]) -> float | None:
    """`row`'s decode tok/s over llama.cpp's in the same round (None without that run)."""
    ref = next((r["decode_tok_s"] for r in rows if r["config"] == "llama-cpp"
                and r.get("round", 1) == row.get("round", 1) and "decode_tok_s" in r), None)
    return row["decode_tok_s"] / ref if ref and "decode_tok_s" in row else None


def summarize_rounds(rows: list[dict]) -> dict[str, dict]:
    """Per configuration: its rounds, median decode tok/s and median same-round ratio."""
    summary = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config and "decode_tok_s" in r]
        ratios = [x for x in (llama_cpp_ratio(r, rows) for r in mine) if x is not None]
        if mine:
            summary[config] = {
                "rounds": len(mine),
                "median_decode_tok_s": statistics.median(r["decode_tok_s"] for r in mine),
                "median_ratio": statistics.median(ratios) if ratios else None,
                "ratios": ratios}
    return summary


def print_table(rows: list[dict], cpu: str, model: str, types: dict[str, int]) -> None:
    print(f"\nW1 (32-token prompt, 256 greedy tokens, ignore_eos) on {cpu}")
    print(f"GGUF {model}: tensors by type {types}")
    print("| config | round | decode tok/s | vs llama.cpp, same round | TTFT 32 (ms) | total (s) |"
          " same ids as first |")
    print("|---" * 7 + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | {r.get('round', 1)} | failed: "
                  f"{r['error'].splitlines()[0][:80]} ||||| ")
            continue
        ratio = llama_cpp_ratio(r, rows)
        print(f"| {r['config']} | {r.get('round', 1)} | {r['decode_tok_s']:.1f} | "
              f"{f'{ratio:.2f}x' if ratio else '-'} | {r['ttft_lone_ms']:.0f} |"
              f" {r['wall_s']:.2f} | {r['same_ids']:.0f} |")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--llama-worker":
        job = json.loads(Path(argv[1]).read_text())
        Path(argv[2]).write_text(json.dumps(run_llama_cpp(job)))
        return 0
    p = bench_w2.build_parser()
    p.description = __doc__.splitlines()[0]
    p.set_defaults(configs=DEFAULT_CONFIGS, num_prompts=1, input_len=32, output_len=256,
                   graph_bs=[1], output="w1_results.json")
    p.add_argument("--gguf-type", default="Q4_1",
                   help="GGUF type of the default model to run (Q4_1: the packaged file)")
    p.add_argument("--gguf-dir", default="~/.cache/airserve/w1_gguf",
                   help="where requantized GGUF files are made once and kept")
    args = p.parse_args(argv)
    args.model_path = gguf_file(args.gguf_type, args.gguf_dir, args.num_threads)
    types = tensor_types(args.model_path)
    cpu, flags = bench_w2.host_cpu()
    job = bench_w2.make_job(args)
    job["prompts"] = [job["lone_prompt"]]  # the TTFT prompt is the W1 prompt
    job["model_path"] = args.model_path
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_w1_") as tmp_name:
        for rnd, config in ((r, c) for r in range(args.rounds) for c in args.configs):
            print(f"== {config}" + (f" (round {rnd + 1})" if args.rounds > 1 else ""),
                  flush=True)
            row: dict[str, Any] = {"config": config, "round": rnd + 1}
            try:
                row.update(run_config(config, job, args, Path(tmp_name)))
                decode_s = row["wall_s"] - row["ttft_lone_ms"] / 1000
                row["decode_tok_s"] = (row["output_tokens"] - 1) / decode_s
                first = next((r for r in rows if "output_ids" in r), row)
                row["same_ids"] = bench_w2.same_share(row["output_ids"], first["output_ids"])
                print(f"   {row['decode_tok_s']:.1f} decode tok/s", flush=True)
            except Exception as e:  # one configuration failing must not lose the others
                row["error"] = str(e)
                print(f"   failed: {e}", flush=True)
            rows.append(row)
    model = Path(args.model_path).name
    print_table(rows, cpu, model, types)
    summary = summarize_rounds(rows)
    if args.rounds > 1:
        print("\n| config | rounds | median decode tok/s | median ratio vs llama.cpp, same round |"
              " ratios |")
        print("|---" * 5 + "|")
        for config, v in summary.items():
            med = f"{v['median_ratio']:.2f}x" if v["median_ratio"] else "-"
            print(f"| {config} | {v['rounds']} | {v['median_decode_tok_s']:.1f} | {med} | "
                  f"{' '.join(f'{x:.2f}' for x in v['ratios'])} |")
    result = {"workload": "W1: 32-token prompt, 256 greedy new tokens, ignore_eos",
              "gguf": model, "gguf_type": args.gguf_type, "tensor_types": types, "cpu": cpu,
              "cpu_features": [f for f in bench_w2.FEATURES if f in flags],
              "threads": args.num_threads,
              "rounds": args.rounds, "summary": summary,
              "rows": [{k: v for k, v in r.items() if k != "output_ids"} for r in rows]}
    Path(args.output).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.output}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
