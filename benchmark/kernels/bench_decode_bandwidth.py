"""Are the bs-1 decode products at this machine's memory bandwidth?

One decode step's packed products of the default model (SmolLM2-135M: 30 layers of q/k/v
[960, 576], o [576, 576], gate/up [3072, 576] and down [576, 1536] in Q4_1, with float32
activations, with int8 ones and with int16 ones, then the Q8_0 lm_head [49152, 576] with float32
activations), each layer with
weights of its own so that a step reads all 66 MB (+ 30 MB) from memory as the model does,
against a streaming read (a float32 sum) of as many bytes. Weight values are random bytes:
only the timing matters. Prints milliseconds per step and GB/s of weight bytes (median and
best of the repeats), and `cached`: the same products on one layer's weights reused (from the
L3 cache), which is the kernels' compute rate. With one thread the times are the thread's CPU
time, so a busy machine's descheduling does not count; with more, wall time (noisy on a shared
machine). `--float32-isa` / `--int8-isa` narrow the products to one instruction set. JSON
with `--json`.

    python benchmark/kernels/bench_decode_bandwidth.py [--threads 1 2] [--repeats 40]
        [--float32-isa avx2] [--int8-isa avx2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [N, K] per layer, Q4_1
LM_HEAD = (49152, 576)  # Q8_0


def q4_1(n: int, k: int) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
            (torch.rand(n, k // 32) * 0.01).half(), (torch.rand(n, k // 32) * -0.01).half())


def nbytes(tensors) -> int:
    return sum(t.nbytes for t in tensors)


def workloads() -> dict:
    """name -> (callable, weight bytes it reads)."""
    layers = [[q4_1(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    xs = {k: torch.randn(1, k) for k in {k for _, k in SHAPES}}
    n, k = LM_HEAD
    head = (torch.randint(-127, 128, (n, k), dtype=torch.int8),
            (torch.rand(n, k // 32) * 0.01).half())
    layer_bytes = sum(nbytes(w) for ws in layers for w in ws)
    stream = torch.rand(layer_bytes // 4)

    def products(weights, activations="int8"):
        def run():
            for ws in weights:
                for (_, k), w in zip(SHAPES, ws):
                    if activations == "int8":
                        torch.ops.airserve.block_matmul_int8(xs[k], "q4_1", *w)
                    elif activations == "int16":
                        torch.ops.airserve.q4_1_matmul_i16(xs[k], *w)
                    else:
                        torch.ops.airserve.q4_1_matmul(xs[k], *w)
        return run

    return {"stream_read": (lambda: stream.sum(), layer_bytes),
            "q4_1_f32_layers": (products(layers, "float32"), layer_bytes),
            "q4_1_f32_cached": (products([layers[0]] * LAYERS, "float32"), layer_bytes),
            "q4_1_int8_layers": (products(layers), layer_bytes),
            "q4_1_int8_cached": (products([layers[0]] * LAYERS), layer_bytes),
            "q4_1_int16_layers": (products(layers, "int16"), layer_bytes),
            "q4_1_int16_cached": (products([layers[0]] * LAYERS, "int16"), layer_bytes),
            "lm_head_q8_0_f32": (lambda: torch.ops.airserve.q8_0_matmul(xs[576], *head),
                                 nbytes(head))}


def measure(threads: int, repeats: int, work: dict) -> list[dict]:
    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in work}
    for _ in range(repeats):  # the workloads take turns, so slow spells hit all alike
        for name, (fn, _) in work.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    rows = []
    for name, ts in times.items():
        size = work[name][1]
        med, best = statistics.median(ts), min(ts)
        rows.append({"threads": threads, "work": name, "mb": size / 1e6, "median_ms": med * 1e3,
                     "best_ms": best * 1e3, "median_gbs": size / med / 1e9,
                     "best_gbs": size / best / 1e9,
                     "clock": "thread CPU time" if threads == 1 else "wall"})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--float32-isa", default="auto",
                   help="narrow the float32 products to one instruction set (avx512, avx2, ...)")
    p.add_argument("--int8-isa", default="auto",
                   help="narrow the int8 products to one instruction set (avx512_vnni, avx2, ...)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from airserve.srt.hardware import host_cpu
    from airserve.srt.layers.quant.block_matvec import kernels_available, unavailable_reason

    if not kernels_available():
        raise SystemExit(f"airserve's CPU kernels are not built: {unavailable_reason()}")
    from airserve.srt.layers.quant.block_matvec import use_float32_isa, use_int8_isa

    isas = {"float32": use_float32_isa(a.float32_isa), "int8": use_int8_isa(a.int8_isa)}
    print(f"instruction sets: float32 {isas['float32']}, int8 {isas['int8']}")
    work = workloads()
    rows = [r for t in a.threads for r in measure(t, a.repeats, work)]
    print(f"{'threads':>7} {'work':18} {'MB':>6} {'median ms':>9} {'best ms':>8} "
          f"{'GB/s med':>8} {'GB/s best':>9}")
    for r in rows:
        print(f"{r['threads']:7d} {r['work']:18} {r['mb']:6.1f} {r['median_ms']:9.2f} "
              f"{r['best_ms']:8.2f} {r['median_gbs']:8.2f} {r['best_gbs']:9.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": host_cpu()[0], "instruction_sets": isas,
                       "note": "shared machine: figures are noisy", "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
