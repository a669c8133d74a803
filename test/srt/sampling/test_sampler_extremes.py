"""The sampler fed every extreme value that validation accepts: valid ids, never an exception,
and rows at the greedy limit equal argmax."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

from airserve.srt.sampling.sampler import SamplingError, sample, sample_one
from airserve.srt.sampling.sampling_params import SamplingParams

TINY = sys.float_info.min * sys.float_info.epsilon  # 5e-324, the smallest positive double
HUGE = sys.float_info.max

# Per field, the extremes that SamplingParams.from_dict accepts.
EXTREMES = {
    "temperature": [0.0, TINY, 1e-300, 1e-40, 1e-7, 1e-6, 0.5, 1.0, 1e6, 1e30, 1e300, HUGE],
    "top_p": [TINY, 1e-300, 1e-12, 0.5, 1 - 1e-16, 1.0],
    "top_k": [-1, 0, 1, 2, 10**9, 2**31 - 1],
    "min_p": [0.0, TINY, 1e-300, 0.5, 1.0],
    "frequency_penalty": [-2.0, -TINY, 0.0, TINY, 2.0],
    "presence_penalty": [-2.0, -TINY, 0.0, 2.0],
    "repetition_penalty": [TINY, 1e-300, 1e-40, 0.5, 1.0, 2.0],
    "min_new_tokens": [0, 10**9],
    "seed": [None, 0, 2**63 - 1],
}
VOCAB = 64


def rows(n: int, seed: int) -> torch.Tensor:
    """Logits with large spreads, ties and exact zeros, as a real model can produce."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, VOCAB, generator=g) * 30
    logits[:, 5] = logits[:, 6]  # a tie
    logits[:, 7] = 0.0
    return logits


def params_for(field: str, value) -> SamplingParams:
    # min_new_tokens may not exceed max_new_tokens.
    most = value if field == "min_new_tokens" else 8
    return SamplingParams.from_dict({field: value, "max_new_tokens": most})


def generator_for(p: SamplingParams) -> torch.Generator | None:
    return torch.Generator().manual_seed(p.seed) if p.seed is not None else None


@pytest.mark.parametrize("field", sorted(EXTREMES))
def test_every_extreme_value_gives_valid_ids_in_a_mixed_batch(field):
    """One batch: every extreme of one field, next to ordinary rows; with history for the
    penalties and EOS banned where min_new_tokens asks for it."""
    params = [params_for(field, v) for v in EXTREMES[field]]
    params += [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_p=0.9)]
    logits = rows(len(params), seed=len(field))
    prompt = [[1, 2, 3, 7, 5]] * len(params)
    output = [[7, 7, 9, 5, 6]] * len(params)
    banned = [[0] if p.min_new_tokens > len(output[0]) else [] for p in params]
    for _ in range(5):
        ids = sample(logits, params, prompt, output, [generator_for(p) for p in params], banned)
        assert len(ids) == len(params)
        for token, ban in zip(ids, banned):
            assert 0 <= token < VOCAB and token not in ban


@pytest.mark.parametrize("temperature", [0.0, TINY, 1e-300, 1e-40, 1e-7])
def test_greedy_limit_rows_equal_argmax(temperature):
    logits = rows(8, seed=1)
    logits[:, 5] -= 1.0  # no ties at the top
    params = [SamplingParams(temperature=temperature, top_p=0.9)] * 8
    got = sample(logits, params, [[]] * 8, [[]] * 8, [torch.Generator().manual_seed(0)] * 8)
    assert got == logits.argmax(-1).tolist()


def test_tiny_repetition_penalty_stays_finite_and_pushes_seen_tokens():
    """repetition_penalty 5e-324 divides positive seen logits into +inf in float64: they tie at
    the top, and a negative seen logit goes to -0, above every other negative."""
    logits = torch.full((VOCAB,), -1.0)
    logits[3] = 2.0
    logits[4] = 1.0
    logits[9] = -3.0
    p = SamplingParams(repetition_penalty=TINY, temperature=1.0)
    drawn = {sample_one(logits, p, [4, 9], [], torch.Generator().manual_seed(s))
             for s in range(30)}
    assert drawn == {4}  # 1/5e-324 = inf -> finite max; every other row is far below
    greedy = SamplingParams(repetition_penalty=TINY, temperature=0)
    assert sample_one(logits, greedy, [4, 9], [], None) == 4


def test_huge_temperature_is_uniform_over_allowed_tokens():
    logits = torch.randn(VOCAB) * 50
    p = SamplingParams(temperature=HUGE)
    g = torch.Generator().manual_seed(0)
    drawn = {sample_one(logits, p, [], [], g, banned=[0, 1]) for _ in range(2000)}
    assert drawn == set(range(2, VOCAB))


def test_all_extreme_combinations_of_the_filters():
    logits = rows(1, seed=4)[0]
    grid = itertools.product(EXTREMES["temperature"], EXTREMES["top_p"], EXTREMES["top_k"],
                             EXTREMES["min_p"])
    g = torch.Generator().manual_seed(0)
    for t, top_p, top_k, min_p in grid:
        p = SamplingParams(temperature=t, top_p=top_p, top_k=top_k, min_p=min_p)
        assert 0 <= sample_one(logits, p, [], [], g) < VOCAB


def test_nan_logits_never_reach_multinomial():
    logits = torch.full((VOCAB,), float("nan"))
    logits[11] = 0.5
    p = SamplingParams(temperature=1.0)
    assert sample_one(logits, p, [], [], None) == 11
    with pytest.raises(SamplingError, match="no token"):
        sample_one(torch.full((VOCAB,), float("nan")), p, [], [], None)
    with pytest.raises(SamplingError, match="no token"):
        sample_one(torch.zeros(VOCAB), p, [], [], None, banned=list(range(VOCAB)))
