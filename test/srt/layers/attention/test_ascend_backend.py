"""The ascend attention backend on CPU: its cache layout, slot writes and host lengths, with the
two torch_npu kernels computed by a reference of their documented semantics (fia_reference).
No torch_npu module is faked: what only an NPU can check is left to test/srt/hardware.

Tolerance: float32 on both sides, the reference and torch_native differ only in summation
order: ATOL as in the graph-runner tests.
"""

from __future__ import annotations

import pytest
import torch

from airserve.srt.forward_batch import ForwardMode
from airserve.srt.layers.attention.ascend_backend import AscendAttnBackend
from airserve.srt.model_executor.model_runner import ModelRunner
from airserve.srt.server_args import ServerArgs
from airserve_testing.fia_reference import ReferenceAttentionOps

ATOL = 1e-4


def runner(path, dtype="float32", model_from=None, ops=None, page_size=16) -> ModelRunner:
    args = ServerArgs(model_path=path, page_size=page_size, max_total_tokens=1024,
                      max_running_requests=4, dtype=dtype)
    mr = (ModelRunner(args) if model_from is None else
          ModelRunner(args, model_config=model_from.model_config, model=model_from.model))
    if ops is not None:
        mr.attn_backend = AscendAttnBackend(mr.allocator, mr.context_len, ops=ops)
    return mr


def generate(mr: ModelRunner, prompts: list[list[int]], steps: int):
    """Prefill, then `steps` greedy decode steps: (decode logits [steps, bs, vocab], tokens)."""
    alloc, pool = mr.allocator, mr.req_to_token_pool
    slots = [pool.allocate() for _ in prompts]
    lens = [len(p) for p in prompts]
    locs = [alloc.allocate(s, 0, n) for s, n in zip(slots, lens)]
    last = [sum(lens[: i + 1]) - 1 for i in range(len(lens))]
    fb = mr.make_forward_batch(
        ForwardMode.EXTEND, input_ids=[t for p in prompts for t in p],
        positions=[i for p in prompts for i in range(len(p))], req_pool_indices=slots,
        seq_lens=lens, out_cache_loc=torch.cat(locs), extend_seq_lens=lens,
        extend_prefix_lens=[0] * len(prompts), last_token_indices=last)
    tokens = mr.forward(fb).argmax(-1).tolist()
    out = []
    for _ in range(steps):
        locs = [alloc.allocate(s, n, n + 1) for s, n in zip(slots, lens)]
        fb = mr.make_forward_batch(ForwardMode.DECODE, input_ids=tokens, positions=lens,
                                   req_pool_indices=slots, seq_lens=[n + 1 for n in lens],
                                   out_cache_loc=torch.cat(locs))
        lens = [n + 1 for n in lens]
        logits = mr.forward(fb)
        out.append(logits)
        tokens = logits.argmax(-1).tolist()
    return torch.stack(out), tokens


def prompts_for(mr: ModelRunner) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, mr.model_config.vocab_size, (n,), generator=g).tolist()
            for n in (5, 21, 38)]


def test_eager_decode_matches_torch_native(tiny_llama_dir):
    native = runner(tiny_llama_dir)
    ascend = runner(tiny_llama_dir, model_from=native, ops=ReferenceAttentionOps())
    expected, tokens_n = generate(native, prompts_for(native), 20)
    got, tokens_a = generate(ascend, prompts_for(native), 20)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert tokens_a == tokens_n
    for a, b in zip(ascend.kv_cache.k_buffers + ascend.kv_cache.v_buffers,
                    native.kv_cache.k_buffers + native.kv_cache.v_buffers):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [1, 8, 24])
def test_page_size_must_suit_fia(tiny_llama_dir, page_size):
    with pytest.raises(ValueError, match="multiple of 16"):
        runner(tiny_llama_dir, page_size=page_size, ops=ReferenceAttentionOps())


@pytest.mark.parametrize("page_size, ok", [(16, True), (128, True), (512, True), (24, False),
                                           (528, False), (1024, False)])
def test_fia_page_size_bounds_are_checked_at_start_up(page_size, ok):
    # Before any model is loaded: ServerArgs itself refuses what FIA cannot run.
    if ok:
        ServerArgs(device="npu", page_size=page_size)
        return
    with pytest.raises(ValueError, match=f"--page-size {page_size}.*multiple of 16 no larger "
                                         "than 512"):
        ServerArgs(device="npu", page_size=page_size)
