"""What a large-batch decode product costs around oneDNN's bf16 matmul.

Above `--packed-decode-max-bs` a decode step multiplies through the layer's large path: with
bf16 weights (`--dtype auto` on a CPU with bf16 dot products) each product casts the float32
activations to bf16, runs oneDNN's bf16 matmul over the reordered weight, widens the result to
float32 and, for down_proj, adds back its residual channels in float32. This loads the default
model (its own layers and weights) and times, per distinct layer and row count:

  op      `airserve::packed_or_large` as the compiled decode graph calls it (from Python here)
  cpp     `airserve::bf16_linear_cpp`: cast, product, widen (+ residual channels)
  bf16    the bare oneDNN bf16 product on activations cast beforehand
  cast / widen   the two conversions alone

and the step total over the model's 30 layers (+ lm_head): `cpp - bf16` is what the float32
boundary costs a step. Median of `--repeats` timings of `--calls` calls each; wall time on a
shared machine is noisy. JSON with `--json`.

    python benchmark/kernels/bench_large_path_overhead.py [--rows 16 64 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def timed(fn, calls: int, repeats: int) -> float:
    """Median microseconds per call."""
    for _ in range(calls):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from airserve.srt.layers.linear import Linear
    from airserve.srt.layers.quant.packed_or_large import packed_or_large
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.server_args import ServerArgs

    runner = ModelRunner(ServerArgs(num_threads=a.threads, max_running_requests=max(a.rows)))
    layers: dict[str, tuple[Linear, int]] = {}
    for name, module in runner.model.named_modules():
        if isinstance(module, Linear):
            key = name.split(".")[-1]
            layer, count = layers.get(key, (module, 0))
            layers[key] = (layer, count + 1)
    if any(layer.weight_bf16 is None for layer, _ in layers.values()):
        raise SystemExit("the layers have no bf16 large path on this CPU (--dtype auto chose "
                         "float32): nothing to measure")

    rows_out = []
    print(f"CPU: {cpu_name()}, {a.threads} threads; microseconds per product (median)")
    print(f"{'rows':>5} {'layer':<14} {'N':>6} {'K':>5} {'resid':>5} {'op':>8} {'cpp':>8} "
          f"{'bf16':>8} {'cast':>7} {'widen':>7} {'x layers':>8}")
    for m in a.rows:
        step = {"op": 0.0, "cpp": 0.0, "bf16": 0.0}
        for key, (layer, count) in layers.items():
            w = layer.weight_bf16
            x = torch.randn(m, w.in_features)
            xb = torch.ops.airserve.cast_to_bf16(x)
            yb = torch.ops.mkldnn._linear_pointwise(xb, w.packed, None, "none", [], "") \
                if w.onednn else torch.nn.functional.linear(xb, w.packed)
            # Each timed call binds this iteration's tensors (default arguments).
            product = (lambda xb=xb, w=w: torch.ops.mkldnn._linear_pointwise(
                xb, w.packed, None, "none", [], "")) if w.onednn else \
                (lambda xb=xb, w=w: torch.nn.functional.linear(xb, w.packed))
            row = {
                "rows": m, "layer": key, "count": count, "N": w.out_features,
                "K": w.in_features, "residual_channels": 0 if w.channels is None
                else int(w.channels.numel()),
                "op_us": timed(lambda layer=layer, x=x: packed_or_large(layer, x, True), a.calls,
                               a.repeats),
                "cpp_us": timed(lambda x=x, w=w: torch.ops.airserve.bf16_linear_cpp(
                    x, w.handle, False), a.calls, a.repeats),
                "bf16_us": timed(product, a.calls, a.repeats),
                "cast_us": timed(lambda x=x: torch.ops.airserve.cast_to_bf16(x), a.calls,
                                 a.repeats),
                "widen_us": timed(lambda yb=yb: torch.ops.airserve.widen_to_f32(yb), a.calls,
                                  a.repeats),
            }
            rows_out.append(row)
            for k in step:
                step[k] += row[f"{k}_us"] * count
            print(f"{m:>5} {key:<14} {row['N']:>6} {row['K']:>5} {row['residual_channels']:>5} "
                  f"{row['op_us']:>8.1f} {row['cpp_us']:>8.1f} {row['bf16_us']:>8.1f} "
                  f"{row['cast_us']:>7.1f} {row['widen_us']:>7.1f} {count:>8}")
        print(f"{m:>5} step total (ms): op {step['op'] / 1e3:.2f}, cpp {step['cpp'] / 1e3:.2f}, "
              f"bare bf16 {step['bf16'] / 1e3:.2f}; the float32 boundary "
              f"{(step['cpp'] - step['bf16']) / 1e3:.2f} ms")
        rows_out.append({"rows": m, "layer": "step", **{f"{k}_ms": v / 1e3 for k, v in
                                                         step.items()}})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_name(), "threads": a.threads, "torch": torch.__version__,
                       "rows": rows_out}, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
