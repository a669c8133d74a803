"""Micro-benchmark of the CPU paged decode attention operator, implementations side by side.

The default model's heads (9 query heads over 3 KV heads of 64), float32, page size 1 with a
shuffled block table (`--kv-dtype` and `--page-size` take several values, timed side by
side), batch sizes 1/8/64, cached lengths 32/256/1024/2048, 1 and 2 threads.
Implementations (`--ops`):

- `cpp`: the operator as the package builds it (`torch.ops.airserve.paged_decode_attention_cpu`);
  `cpp:scalar` / `cpp:avx2` the same with its instruction set narrowed;
- `torch`: the plain torch ops path (`torch.ops.airserve.paged_decode_attention`);
- `git:REV`: `csrc/decode_attention.cpp` and the headers beside it as of a git revision (e.g.
  `git:main`, the kernel before a change), built alone under its own operator namespace, same
  compiler flags;
- `file:PATH`: a source file of the operator, built the same way.

The implementations take turns call by call, so a busy machine's slow spells hit them alike.
Prints median microseconds per call and writes JSON naming the CPU.

`--layers N` gives each call N caches of its own, as a decode step over N layers reads them (30:
W2's 64 x 192 positions no longer fit in the caches, so the timing includes the reads from
memory); a "call" is then the N calls of one step. `--kv-dtype` sets the caches' element type.

    python benchmark/kernels/bench_decode_attention.py [--ops git:main cpp] [--json F]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch

from airserve.srt.hardware import host_cpu
from airserve.srt.mem_cache.memory_pool import kv_rows

SOURCE = "python/airserve/srt/layers/csrc/decode_attention.cpp"
CSRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", os.path.dirname(SOURCE)))
SCHEMA = ("paged_decode_attention_cpu(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, "
          "Tensor(b!) v_cache, Tensor out_cache_loc, Tensor block_table, Tensor seq_lens, "
          "int page_size, float scale) -> Tensor")
IMPL_LINE = "TORCH_LIBRARY_IMPL(airserve, CPU, lib) {"


def load_source(text: str, includes: dict[str, str] | None = None):
    """Builds one operator source under a namespace of its own, beside `includes` (file name ->
    text: the files it includes, as of its revision; default: the package's); returns the op."""
    from torch.utils import cpp_extension

    assert IMPL_LINE in text, "the source no longer registers its op the expected way"
    tag = hashlib.sha1((text + json.dumps(includes, sort_keys=True)).encode()).hexdigest()[:10]
    namespace = f"airserve_bench_{tag}"
    text = text.replace(IMPL_LINE, f'TORCH_LIBRARY({namespace}, lib) {{\n  lib.def("{SCHEMA}");')
    text = text.replace("TORCH_LIBRARY_FRAGMENT(airserve_isa,", f"TORCH_LIBRARY({namespace}_isa,")
    # A directory of its own: a quoted #include looks beside the source first.
    folder = os.path.join(tempfile.gettempdir(), namespace)
    os.makedirs(folder, exist_ok=True)
    for name, body in (includes or {}).items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(body)
    path = os.path.join(folder, f"{namespace}.cpp")
    with open(path, "w") as f:
        f.write(text)
    cpp_extension.load(name=namespace, sources=[path], extra_include_paths=[CSRC],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return getattr(torch.ops, namespace).paged_decode_attention_cpu.default


def git_sources(rev: str) -> tuple[str, dict[str, str]]:
    """The operator's source and the headers beside it, as of git revision `rev`."""
    folder = os.path.dirname(SOURCE)

    def show(path: str) -> str:
        return subprocess.check_output(["git", "show", f"{rev}:{path}"], text=True)

    names = subprocess.check_output(["git", "ls-tree", "--name-only", rev, folder + "/"],
                                    text=True).split()
    headers = {os.path.basename(n): show(n) for n in names if n.endswith((".h", ".inc"))}
    return show(SOURCE), headers


def resolve(op: str):
    if op == "cpp" or op.startswith("cpp:"):
        from airserve.srt.layers import cpu_kernels
        from airserve.srt.layers.attention import torch_native_backend as tnb

        assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
        fn = torch.ops.airserve.paged_decode_attention_cpu.default
        if op == "cpp":
            return fn
        isa = op[4:]

        def with_isa(*args):
            tnb.use_attention_isa(isa)
            try:
                return fn(*args)
            finally:
                tnb.use_attention_isa("auto")
        return with_isa
    if op == "torch":
        from airserve.srt.layers.attention.torch_native_backend import paged_decode_attention
        return paged_decode_attention
    if op.startswith("git:"):
        return load_source(*git_sources(op[4:]))
    if op.startswith("file:"):
        with open(op[5:]) as f:
            return load_source(f.read())
    raise SystemExit(f"--ops: unknown implementation {op!r} "
                     "(cpp, cpp:ISA, torch, git:REV, file:PATH)")


def make_args(bs: int, length: int, heads=9, kv_heads=3, dim=64,
              kv_dtype=torch.float32, page_size: int = 1) -> tuple:
    """One decode call's arguments: every row `length` tokens long (the new one included), in
    pages of `page_size` slots taken in a shuffled order (page 0 unused, as the allocator's)."""
    g = torch.Generator().manual_seed(0)
    per_row = -(-length // page_size)
    pages = bs * per_row + 1
    k_cache = kv_rows(torch.randn(pages * page_size, kv_heads, dim, generator=g), kv_dtype)
    v_cache = kv_rows(torch.randn(pages * page_size, kv_heads, dim, generator=g), kv_dtype)
    table = (torch.randperm(pages - 1, generator=g) + 1).to(torch.int32).view(bs, per_row)
    last = length - 1
    loc = (table[:, last // page_size].to(torch.int64) * page_size + last % page_size)
    lens = torch.full((bs,), length, dtype=torch.int32)
    q = torch.randn(bs, heads, dim, generator=g)
    k, v = torch.randn(bs, kv_heads, dim, generator=g), torch.randn(bs, kv_heads, dim, generator=g)
    return q, k, v, k_cache, v_cache, loc, table, lens, page_size, dim ** -0.5


def per_step(fn, args: tuple, layers: list[tuple]):
    """fn over each layer's caches in turn (the other arguments are the first layer's)."""
    def step():
        for k_cache, v_cache in layers:
            fn(*args[:3], k_cache, v_cache, *args[5:])
    return step


@torch.inference_mode()
def time_interleaved(steps: dict, seconds: float) -> dict[str, float]:
    """Median microseconds per call of each step, calls taking turns, ~`seconds` in all."""
    start = time.perf_counter()
    for fn in steps.values():
        fn()
    once = (time.perf_counter() - start) / len(steps)
    repeats = max(7, min(300, int(seconds / max(once, 1e-6) / len(steps))))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", nargs="+", default=["git:main", "cpp"])
    p.add_argument("--bs", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--lens", type=int, nargs="+", default=[32, 256, 1024, 2048])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seconds", type=float, default=0.5, help="per configuration")
    p.add_argument("--layers", type=int, default=1,
                   help="caches per call, each its own (a step over this many layers)")
    p.add_argument("--kv-dtype", nargs="+", default=["float32"],
                   choices=("float32", "bfloat16", "float16", "int8"),
                   help="caches of these element types, side by side")
    p.add_argument("--page-size", type=int, nargs="+", default=[1],
                   help="pages of these many slots (shuffled), side by side")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    ops = {name: resolve(name) for name in a.ops}
    model, flags = host_cpu()
    isa = next((f for f in ("avx512f", "avx2") if f in flags), "no avx2")
    print(f"CPU: {model} ({isa}); {'/'.join(a.kv_dtype)} caches, pages of "
          f"{'/'.join(map(str, a.page_size))}, {a.layers} per call")
    variants = [(dt, ps) for dt in a.kv_dtype for ps in a.page_size]
    names = [n if len(variants) == 1 else f"{n}/{dt}/p{ps}"
             for n in ops for dt, ps in variants]
    head = f"{'bs':>3} {'len':>5} {'thr':>3} " + " ".join(f"{n:>18}" for n in names)
    print(head + (f" {'speedup':>8}" if len(names) > 1 else ""))
    rows = []
    for bs in a.bs:
        for length in a.lens:
            steps = {}
            for dt, ps in variants:
                args = make_args(bs, length, kv_dtype=getattr(torch, dt), page_size=ps)
                layers = [args[3:5]] + [tuple(c.clone() for c in args[3:5])
                                        for _ in range(a.layers - 1)]
                for n, fn in ops.items():
                    steps[n if len(variants) == 1 else f"{n}/{dt}/p{ps}"] = per_step(
                        fn, args, layers)
            for threads in a.threads:
                torch.set_num_threads(threads)
                us = time_interleaved(steps, a.seconds)
                first, last = us[names[0]], us[names[-1]]
                rows.append({"bs": bs, "len": length, "threads": threads, "us": us,
                             "speedup_last_vs_first": first / last})
                line = f"{bs:>3} {length:>5} {threads:>3} " + " ".join(
                    f"{us[n]:>18.1f}" for n in names)
                print(line + (f" {first / last:>7.2f}x" if len(names) > 1 else ""), flush=True)
            del steps
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": model, "cpu_isa": isa, "ops": a.ops, "unit": "median us per call",
                       "layers_per_call": a.layers, "kv_dtypes": a.kv_dtype,
                       "page_sizes": a.page_size,
                       "shape": "9 query heads, 3 KV heads, head dim 64, shuffled pages",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
