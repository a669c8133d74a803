"""`python -m airserve_testing.tp_decode MODEL TP OUT [--compile]`: prefill three prompts, run
greedy decode steps on a ModelRunner with --tp-size TP, save the logits (and the runner's
graph replay / eager counts) to OUT. Tensor-parallel tests run it in a subprocess, since a
process joins one torch.distributed group for life."""

from __future__ import annotations

import argparse

import torch

from airserve.srt.model_executor.model_runner import ModelRunner
from airserve.srt.server_args import ServerArgs
from airserve_testing.decode_driver import Requests

STEPS = 6


def decode_logits(runner: ModelRunner, steps: int = STEPS) -> torch.Tensor:
    """Prefill logits then `steps` greedy decode steps' logits, [3 * (steps + 1), vocab]."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (5, 9, 3)]
    reqs = Requests(runner, prompts)
    out = [reqs.prefill_logits]
    for _ in range(steps):
        out.append(reqs.decode(out[-1].argmax(-1).tolist()))
    reqs.release()
    return torch.cat(out)


def runner_args(model: str, tp: int, compile_: bool) -> ServerArgs:
    # float32 whatever the CPU: the parity tolerance is float32's. Under bf16 products (the
    # `auto` path on CPUs with avx512_bf16 or AMX) each rank's partial sums are rounded to bf16
    # before the all-reduce, and the tiny model's logits then differ by up to ~0.15. Exact
    # decode activations for the same reason: the ranks' partial sums reach the next layer
    # with last-bit differences, and where `auto` takes int16 (Q4_1 outside gate/up) its
    # rounding turns such a bit at a step boundary into a step (~1e-2 of this model's logits).
    return ServerArgs(model_path=model, max_total_tokens=512, max_running_requests=8,
                      tp_size=tp, num_threads=1, enable_torch_compile=compile_,
                      cuda_graph_bs=(4,),  # one bucket: the three prompts pad to 4
                      dtype="float32", cpu_decode_activations="float32")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("tp", type=int)
    p.add_argument("out")
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    runner = ModelRunner(runner_args(a.model, a.tp, a.compile))
    logits = decode_logits(runner)
    torch.save({"logits": logits, "graph_replays": runner.graph_replays,
                "fallbacks": dict(runner.fallback_counts)}, a.out)


if __name__ == "__main__":
    main()
