from __future__ import annotations

import pytest
import torch

from airserve.srt.sampling.sampler import apply_penalties, sample
from airserve.srt.sampling.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -1, "temperature"),
    ("top_p", 0, "top_p"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -3, "top_k"),
    ("max_new_tokens", -1, "max_new_tokens"),
    ("max_new_tokens", "12", "max_new_tokens"),
    ("min_p", 2, "min_p"),
    ("repetition_penalty", 0, "repetition_penalty"),
    ("frequency_penalty", 3, "frequency_penalty"),
    ("stop", [""], "stop"),
    ("stop_token_ids", ["a"], "stop_token_ids"),
    ("bogus", 1, "bogus"),
])
def test_bad_sampling_params_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict({field: value})


def test_ignored_and_null_fields_are_accepted():
    p = SamplingParams.from_dict({"regex": None, "json_schema": None, "top_k": -1,
                                  "stop": "Question", "temperature": None})
    assert p.stop == ["Question"] and p.temperature == 1.0 and p.top_k == -1


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0)] * 4
    assert sample(logits, params, [[]] * 4, [[]] * 4, [None] * 4) == logits.argmax(-1).tolist()


def test_all_greedy_batch_takes_argmax_ties_and_nan_included():
    """The all-greedy batch's shortcut (max's indices) picks what argmax picks: the first of
    tied maxima, and a NaN's index where a row holds one."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (16, 300), generator=g).float()  # many ties per row
    logits[3, 7] = logits[3, 250] = float("nan")
    logits[5, :] = float("-inf")
    logits[6, 100] = float("inf")
    params = [SamplingParams(temperature=0)] * 16
    got = sample(logits, params, [[]] * 16, [[]] * 16, [None] * 16)
    assert got == torch.argmax(logits, dim=-1).tolist()
    assert got[3] == 7 and got[6] == 100


def test_same_seed_same_tokens_different_seed_differs():
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0)

    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        return [sample(logits, [p], [[]], [[]], [g])[0] for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, -10.0, -10.0]])
    g = torch.Generator().manual_seed(0)
    for params, allowed in [(SamplingParams(top_k=2), {0, 1}),
                            (SamplingParams(top_p=0.5), {0}),
                            (SamplingParams(min_p=0.3), {0, 1})]:
        seen = {sample(logits, [params], [[]], [[]], [g])[0] for _ in range(200)}
        assert seen <= allowed and seen


def test_penalties():
    row = torch.tensor([2.0, -2.0, 1.0, 1.0])
    out = apply_penalties(row.clone(), SamplingParams(repetition_penalty=2.0), [0, 1], [])
    assert out.tolist() == [1.0, -4.0, 1.0, 1.0]
    out = apply_penalties(row.clone(), SamplingParams(frequency_penalty=0.5,
                                                      presence_penalty=0.25), [], [2, 2, 3])
    assert out.tolist() == [2.0, -2.0, 1.0 - 1.0 - 0.25, 1.0 - 0.5 - 0.25]


def test_banned_tokens_are_never_sampled():
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0)]
    assert sample(logits, params, [[]], [[]], [None], banned=[[0]]) != [0]


def test_sample_never_writes_into_its_logits():
    """The scheduler hands `sample` the forward's logits without a copy (a row-wise retry
    after a failure reads them again): no parameter may change them."""
    logits = torch.randn(5, 64)
    before = logits.clone()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, seed=1),
              SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1, seed=2),
              SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5,
                             presence_penalty=0.5),
              SamplingParams(temperature=0, logit_bias={3: 5.0})]
    gens = [torch.Generator().manual_seed(i) for i in range(5)]
    out = sample(logits, params, [[1, 2]] * 5, [[3, 3]] * 5, gens, banned=[[], [], [], [], [0]])
    assert len(out) == 5
    assert torch.equal(logits, before)
