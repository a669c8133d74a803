"""Our paged-cache model against transformers on the same random weights."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.forward_batch import ForwardMode
from airserve.srt.model_executor.model_runner import ModelRunner
from airserve.srt.server_args import ServerArgs
from airserve_testing.tiny_models import load_hf

# float32 on both sides; differences come only from summation order.
ATOL = 2e-4


def run_prefill_and_decode(runner: ModelRunner, prompts: list[list[int]], steps: int):
    """Prefill `prompts` together, then decode `steps` greedy tokens for all of them.

    Returns (per-request prefill logits [len, vocab], decode logits [steps, bs, vocab],
    generated ids per request)."""
    alloc, pool = runner.allocator, runner.req_to_token_pool
    slots = [pool.allocate() for _ in prompts]
    locs = [alloc.allocate(s, 0, len(p)) for s, p in zip(slots, prompts)]
    lens = [len(p) for p in prompts]
    fb = runner.make_forward_batch(
        ForwardMode.EXTEND, input_ids=[t for p in prompts for t in p],
        positions=[i for p in prompts for i in range(len(p))], req_pool_indices=slots,
        seq_lens=lens, out_cache_loc=torch.cat(locs), extend_seq_lens=lens,
        extend_prefix_lens=[0] * len(prompts), return_all_logits=True,
    )
    logits = runner.forward(fb)
    prefill = list(torch.split(logits, lens))
    tokens = [[int(x[-1].argmax())] for x in prefill]
    decode = []
    for _ in range(steps):
        cur = [len(p) + len(t) - 1 for p, t in zip(prompts, tokens)]
        locs = [alloc.allocate(s, c, c + 1) for s, c in zip(slots, cur)]
        fb = runner.make_forward_batch(
            ForwardMode.DECODE, input_ids=[t[-1] for t in tokens], positions=cur,
            req_pool_indices=slots, seq_lens=[c + 1 for c in cur], out_cache_loc=torch.cat(locs),
        )
        out = runner.forward(fb)
        decode.append(out)
        for t, row in zip(tokens, out):
            t.append(int(row.argmax()))
    return prefill, torch.stack(decode), tokens


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_prefill_and_20_decode_steps_match_transformers(model_type, page_size, request):
    path = request.getfixturevalue(f"tiny_{model_type}_dir")
    # float32 pinned: under --dtype auto a CPU with avx512_bf16 or AMX prefills in bfloat16.
    runner = ModelRunner(ServerArgs(model_path=path, page_size=page_size, max_total_tokens=1024,
                                    max_running_requests=4, dtype="float32"))
    hf = load_hf(path)
    g = torch.Generator().manual_seed(1)
    vocab = runner.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 23, 40)]
    prefill, decode, tokens = run_prefill_and_decode(runner, prompts, steps=20)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            full = torch.tensor([p + tokens[i][:-1]])
            ref = hf(full).logits[0].float()
            torch.testing.assert_close(prefill[i], ref[: len(p)], atol=ATOL, rtol=0)
            torch.testing.assert_close(decode[:, i], ref[len(p):], atol=ATOL, rtol=0)
