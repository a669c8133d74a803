"""refine_top_logits_ (csrc/logits.cpp, models/llama.py): a bfloat16 lm_head rounds its logits to
bf16 and near-equal top tokens tie; each row's candidates for the top are recomputed in float32
in place, so the argmax is float32's, whatever kind of step (decode, extend, mixed) produced the
row. Other logits are untouched; a model turns it on only for a bf16 lm_head holding its float32
weight."""

from __future__ import annotations

import pytest
import torch

from airserve.srt.layers import cpu_kernels
from airserve.srt.layers.linear import Linear
from airserve.srt.models import llama  # noqa: F401  (defines the operator's schema)


def op():
    if not cpu_kernels.available():
        pytest.skip(f"C++ kernels not built: {cpu_kernels.unavailable_reason()}")
    return torch.ops.airserve.refine_top_logits_


def lm_head(vocab=4096, hidden=64, path="bfloat16", keep_float=True, seed=0):
    torch.manual_seed(seed)
    layer = Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        layer.weight.normal_(0, 1)
    layer.set_large_path(path, keep_float=keep_float)
    return layer


def test_refined_candidates_are_float32s():
    refine = op()
    layer = lm_head()
    w = layer.weight.detach()
    hidden = torch.randn(6, 64) * 3
    exact = hidden @ w.t()
    rounded = layer(hidden).float()
    assert not torch.equal(rounded, exact)
    refined = rounded.clone()
    refine(refined, hidden, w, None, 8)
    changed = refined != rounded
    assert changed.any()
    assert (changed.sum(-1) <= 8).all()
    torch.testing.assert_close(refined[changed], exact[changed], rtol=1e-5, atol=1e-4)
    # the candidates are the rows' near-maximal rounded logits; the argmax is float32's
    top = rounded.max(-1, keepdim=True).values
    assert (rounded[changed] >= (top - top.abs() / 128).expand_as(rounded)[changed]).all()
    assert refined.argmax(-1).tolist() == exact.argmax(-1).tolist()


def test_a_tie_after_rounding_goes_to_the_float32_winner():
    """Two tokens 0.05 apart round to one bf16 value; the higher id wins in float32, and after
    refinement (before it, the tie went to the lower id)."""
    refine = op()
    layer = lm_head(vocab=300, hidden=8)
    with torch.no_grad():
        w = torch.zeros(300, 8)
        w[:, 0] = torch.linspace(-1, 1, 300)
        w[10, 0], w[200, 0] = 20.00, 20.05  # hidden = e0: logits 20.00 and 20.05
        layer.weight.copy_(w)
    layer.set_large_path("bfloat16", keep_float=True)
    hidden = torch.zeros(1, 8)
    hidden[0, 0] = 1.0
    logits = layer(hidden).float()
    assert logits[0, 10] == logits[0, 200] and logits.argmax().item() == 10
    bias = torch.zeros(300)
    bias[10] = 0.1  # with a bias the lower id wins again, by 0.05
    with_bias = logits.clone()
    refine(logits, hidden, layer.weight, None, 8)
    assert logits.argmax().item() == 200
    refine(with_bias, hidden, layer.weight, bias, 8)
    assert with_bias.argmax().item() == 10


def test_many_ties_keep_max_k_and_non_finite_rows():
    refine = op()
    w = torch.randn(50, 4)
    hidden = torch.randn(3, 4)
    logits = torch.zeros(3, 50)  # every logit tied: only max_k of them are recomputed
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    before = logits.clone()
    refine(logits, hidden, w, None, 5)
    assert (logits[0] != before[0]).sum() == 5
    assert torch.equal(logits[1:].nan_to_num(), before[1:].nan_to_num())
    with pytest.raises(RuntimeError, match="hidden must be float32"):
        refine(logits, torch.randn(2, 4), w, None, 5)
    with pytest.raises(RuntimeError, match="weight must be float32"):
        refine(logits, hidden, torch.randn(50, 5), None, 5)


def test_model_turns_it_on_only_for_a_bf16_lm_head_with_its_float_weight():
    op()
    from types import SimpleNamespace

    from airserve.srt.models.llama import LlamaForCausalLM

    model = SimpleNamespace(lm_head=lm_head(), refine_logits=False)
    assert LlamaForCausalLM.enable_logit_refinement(model)
    model.lm_head = lm_head(path="float32")
    assert not LlamaForCausalLM.enable_logit_refinement(model)
    model.lm_head = lm_head(keep_float=False)
    assert not LlamaForCausalLM.enable_logit_refinement(model)
