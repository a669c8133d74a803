"""One bs-1 decode step of the default model (eager), float32 against int8 activations in the
packed products, the two taking turns step by step in one process (so a busy machine's slow
spells hit both alike). Prints the median milliseconds per step of each and their ratio.
`--scheme Q4_K_M` (or another of gguf_quantize.SCHEMES) requantizes the linear layers first, as
fidelity.py does (this 576-wide model's Q4_K_M is mostly Q5_0); `--by-kind` adds, per variant,
the median milliseconds a step spends in the linear layers of each block kind.

    python benchmark/kernels/decode_step.py [--steps 40] [--threads 2] [--scheme Q4_K_M]
        [--by-kind] [--json F]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch

ACTIVATIONS = ("float32", "auto")


class KindTimer:
    """Wall time of every packed Linear's forward, summed per step by its block kinds
    ("q5_0", "q4_k+q8_0" for a merged layer of two kinds); `take()` ends a step."""

    def __init__(self, model: torch.nn.Module):
        from airserve.srt.layers.linear import Linear

        self.step: dict[str, float] = {}
        self.t0: dict[int, float] = {}
        for m in model.modules():
            if isinstance(m, Linear) and m.packed_max_rows:
                name = "+".join(sorted(set(m.packed_kinds)))
                m.register_forward_pre_hook(self._start)
                m.register_forward_hook(functools.partial(self._stop, name))

    def _start(self, module, args) -> None:
        self.t0[id(module)] = time.perf_counter()

    def _stop(self, name: str, module, args, out) -> None:
        dt = time.perf_counter() - self.t0[id(module)]
        self.step[name] = self.step.get(name, 0.0) + dt * 1e3

    def take(self) -> dict[str, float]:
        step, self.step = self.step, {}
        return step


def set_activations(model: torch.nn.Module, activations: str) -> None:
    from airserve.srt.layers.linear import Linear

    for m in model.modules():
        if isinstance(m, Linear) and m.packed_max_rows:
            m.packed_activations = activations


@torch.inference_mode()
def interleaved_steps(runner, variants: dict[str, Callable[[], None]], steps: int,
                      prompt_len: int = 32, kinds: KindTimer | None = None) -> dict:
    """Prefill one prompt, then greedy bs-1 decode steps with each variant in turn (its
    callable switches the runner to it before its step): median milliseconds per step of each
    (`<name>_ms`) and the cached lengths at the start and the end; with `kinds`, also the
    median milliseconds per step in each kind's linear layers (`<name>_by_kind`)."""
    from airserve.srt.forward_batch import ForwardMode

    slot = runner.req_to_token_pool.allocate()
    loc = runner.allocator.allocate(slot, 0, prompt_len)
    fb = runner.make_forward_batch(
        ForwardMode.EXTEND, input_ids=list(range(100, 100 + prompt_len)),
        positions=list(range(prompt_len)), req_pool_indices=[slot], seq_lens=[prompt_len],
        out_cache_loc=loc, extend_seq_lens=[prompt_len], extend_prefix_lens=[0],
        last_token_indices=[prompt_len - 1])
    token = int(runner.forward(fb).argmax(-1)[0])
    n = prompt_len
    times: dict[str, list[float]] = {name: [] for name in variants}
    by_kind: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for step in range(steps + 2):  # two warm-up steps each
        for name, switch in variants.items():
            switch()
            loc = runner.allocator.allocate(slot, n, n + 1)
            fb = runner.make_forward_batch(
                ForwardMode.DECODE, input_ids=[token], positions=[n], req_pool_indices=[slot],
                seq_lens=[n + 1], out_cache_loc=loc)
            if kinds:
                kinds.take()
            t0 = time.perf_counter()
            token = int(runner.forward(fb).argmax(-1)[0])
            if step >= 2:
                times[name].append((time.perf_counter() - t0) * 1e3)
                if kinds:
                    by_kind[name].append(kinds.take())
            n += 1
    runner.allocator.free(slot, n)
    runner.req_to_token_pool.free(slot)
    row = {f"{name}_ms": statistics.median(t) for name, t in times.items()}
    if kinds:
        for name, rows in by_kind.items():
            row[f"{name}_by_kind"] = {k: statistics.median(r.get(k, 0.0) for r in rows)
                                      for k in sorted(rows[0])}
    return row | {"cached_tokens": [prompt_len, n]}


def measure(runner, steps: int, by_kind: bool = False) -> dict:
    return interleaved_steps(
        runner, {a: functools.partial(set_activations, runner.model, a) for a in ACTIVATIONS},
        steps, kinds=KindTimer(runner.model) if by_kind else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--scheme", default=None,
                   help="requantize the linear layers to this gguf_quantize scheme first")
    p.add_argument("--by-kind", action="store_true",
                   help="time the linear layers of each block kind too")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from airserve.srt.layers.quant.block_matvec import AUTO_INT8_KINDS
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.server_args import ServerArgs

    args = ServerArgs(num_threads=a.threads, max_total_tokens=4096)
    if a.scheme:  # as fidelity.make_runner: plain float32 weights, requantized, then the runner
        from airserve.srt.model_loader.gguf_quantize import requantize_linears
        from airserve.srt.model_loader.loader import load_model

        torch.set_num_threads(a.threads)
        bs = args.packed_decode_max_bs
        cfg, model = load_model(None, "float32", "cpu", None, bs, False, "auto")
        requantize_linears(model, a.scheme, bs, "auto")
        runner = ModelRunner(args, model_config=cfg, model=model)
    else:
        runner = ModelRunner(args)
    row = {"threads": a.threads, "steps": a.steps, "scheme": a.scheme or "Q4_1",
           **measure(runner, a.steps, a.by_kind)}
    row["speedup"] = row["float32_ms"] / row["auto_ms"]
    print(f"bs 1 decode step, {a.threads} threads, {row['scheme']}: float32 "
          f"{row['float32_ms']:.2f} ms, auto (int8 for {'/'.join(sorted(AUTO_INT8_KINDS))}) "
          f"{row['auto_ms']:.2f} ms, {row['speedup']:.2f}x")
    for act in ACTIVATIONS if a.by_kind else ():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in row[f"{act}_by_kind"].items())
        print(f"  {act}: linear layers by kind (ms per step): {parts}")
    write_row(a.json, row)


def write_row(path: str | None, row: dict) -> None:
    """The row as JSON at `path` (nothing without one)."""
    if path:
        with open(path, "w") as f:
            json.dump({**row, "note": "median of interleaved steps; shared machine"}, f, indent=1)


if __name__ == "__main__":
    main()
