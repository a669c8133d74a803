"""Drive a ModelRunner request by request, so two runners can be fed the same steps."""

from __future__ import annotations

import itertools

import torch

from airserve.srt.forward_batch import ForwardMode
from airserve.srt.model_executor.model_runner import ModelRunner
from airserve.srt.server_args import ServerArgs


def make_runner(model_path: str, runner_from: ModelRunner | None = None, **kwargs) -> ModelRunner:
    """A runner over `model_path`; with `runner_from`, one that shares its model object.
    float32 unless `dtype` says otherwise: these runners are compared step by step, and under
    a bf16 large path (--dtype auto on CPUs with bf16) a batch padded into a bucket may take
    another oneDNN kernel than the eager batch, float32 rounding apart, which the products'
    bf16 rounding can turn into one bf16 step of difference."""
    kwargs.setdefault("dtype", "float32")
    args = ServerArgs(model_path=model_path, max_total_tokens=2048, max_running_requests=8,
                      **kwargs)
    if runner_from is None:
        return ModelRunner(args)
    return ModelRunner(args, model_config=runner_from.model_config, model=runner_from.model)


def tiny_gguf_runners(directory: str, buckets: tuple[int, ...] | None, packed_limit: int,
                      reference: dict, **flags) -> tuple[ModelRunner, ModelRunner, ModelRunner]:
    """A tiny llama GGUF of packed block kinds written under `directory`, and three runners on
    it: a CPU graph runner with `buckets` (None: the default schedule) and an eager one,
    sharing one model loaded with `flags`, and a reference runner loaded with `reference` flags
    instead."""
    import os

    import pytest

    from airserve.srt.layers import cpu_kernels
    from airserve.srt.model_executor.graph_runners.cpu import CPUGraphRunner
    from airserve_testing.tiny_gguf import PACKED_TYPES, write_tiny_gguf

    if not cpu_kernels.available():
        pytest.fail(f"the CPU kernels did not build: {cpu_kernels.unavailable_reason()}")
    path = os.path.join(directory, "tiny.gguf")
    write_tiny_gguf(path, "llama", qtypes=PACKED_TYPES)
    eager = make_runner(path, packed_decode_max_bs=packed_limit, **flags)
    graph = make_runner(path, runner_from=eager, packed_decode_max_bs=packed_limit,
                        enable_torch_compile=True, cuda_graph_bs=buckets, **flags)
    assert isinstance(graph.graph_runner, CPUGraphRunner)
    return graph, eager, make_runner(path, packed_decode_max_bs=packed_limit, **reference)


def random_prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


class Requests:
    """Requests prefilled on one runner and stepped one decode token at a time."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]]) -> None:
        self.runner = runner
        alloc, pool = runner.allocator, runner.req_to_token_pool
        self.slots = [pool.allocate() for _ in prompts]
        locs = [alloc.allocate(s, 0, len(p)) for s, p in zip(self.slots, prompts)]
        self.lens = [len(p) for p in prompts]
        last = [n - 1 for n in itertools.accumulate(self.lens)]
        fb = runner.make_forward_batch(
            ForwardMode.EXTEND, input_ids=[t for p in prompts for t in p],
            positions=[i for p in prompts for i in range(len(p))],
            req_pool_indices=self.slots, seq_lens=self.lens, out_cache_loc=torch.cat(locs),
            extend_seq_lens=self.lens, extend_prefix_lens=[0] * len(prompts),
            last_token_indices=last,
        )
        self.prefill_logits = runner.forward(fb)

    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One decode step feeding `tokens` (one per request): logits [bs, vocab]."""
        alloc = self.runner.allocator
        locs = [alloc.allocate(s, n, n + 1) for s, n in zip(self.slots, self.lens)]
        fb = self.runner.make_forward_batch(
            ForwardMode.DECODE, input_ids=tokens, positions=self.lens,
            req_pool_indices=self.slots, seq_lens=[n + 1 for n in self.lens],
            out_cache_loc=torch.cat(locs),
        )
        self.lens = [n + 1 for n in self.lens]
        return self.runner.forward(fb)

    def release(self) -> None:
        for slot, n in zip(self.slots, self.lens):
            self.runner.allocator.free(slot, n)
            self.runner.req_to_token_pool.free(slot)


def zero_kv(runner: ModelRunner) -> None:
    for buf in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers:
        buf.zero_()


def run_side_by_side(graph: ModelRunner, eager: ModelRunner, prompts: list[list[int]],
                     steps: int):
    """Prefill and decode `steps` tokens on both runners, feeding both eager's greedy tokens.

    Returns (graph logits [steps, bs, vocab], eager logits, graph greedy tokens, eager greedy
    tokens); leaves the requests' KV in both pools until `release` of the returned handles."""
    reqs = (Requests(graph, prompts), Requests(eager, prompts))
    tokens = reqs[1].prefill_logits.argmax(-1).tolist()
    out_g, out_e = [], []
    for _ in range(steps):
        lg = reqs[0].decode(tokens)
        le = reqs[1].decode(tokens)
        out_g.append(lg)
        out_e.append(le)
        tokens = le.argmax(-1).tolist()
    g, e = torch.stack(out_g), torch.stack(out_e)
    return g, e, g.argmax(-1), e.argmax(-1), reqs


# Prompt lengths of the batches replay_matches_eager decodes (the first `bs` of them).
PROMPT_LENGTHS = (5, 17, 9, 12, 7, 3, 11, 6)


def replay_matches_eager(graph: ModelRunner, eager: ModelRunner, bs: int, atol: float,
                         steps: int = 6):
    """Decode `steps` tokens of `bs` prompts on `graph` (a graph runner) and `eager` side by
    side: every step a replay, logits within `atol`, the same greedy tokens. Returns (eager's
    greedy tokens [steps, bs], the requests' handles (graph's, eager's)) for more steps."""
    replays = graph.graph_runner.replay_count
    prompts = random_prompts(graph.model_config.vocab_size, list(PROMPT_LENGTHS[:bs]))
    lg, le, tg, te, reqs = run_side_by_side(graph, eager, prompts, steps=steps)
    assert graph.graph_runner.replay_count == replays + steps
    torch.testing.assert_close(lg, le, atol=atol, rtol=0)
    assert torch.equal(tg, te)
    return te, reqs


def q4_1_decode_op(runner: ModelRunner) -> str:
    """The operator a Q4_1 layer's packed decode product (outside gate/up) calls under
    `runner`'s --cpu-decode-activations (int8: the int8 product; int16, and auto where it takes
    int16: the int16 product; float32: the float32 one)."""
    from airserve.srt.layers.quant.block_matvec import resolve_activations

    act = resolve_activations(runner.server_args.cpu_decode_activations, "q4_1")
    return {"int8": "airserve::block_matmul_int8",
            "int16": "airserve::q4_1_matmul_i16"}.get(act, "airserve::q4_1_matmul")
