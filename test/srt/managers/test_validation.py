"""The one request check (managers/validation.py and SamplingParams.from_dict), without a
server: every sampling field by type and range, request-level limits, JSON content."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airserve.srt.managers.validation import (
    FieldError,
    RequestLimits,
    SamplingParams,
    check_fits,
    check_json_value,
    check_text,
    max_chars_per_token,
    parse_logprob,
    validate_request,
)
from airserve.srt.sampling.sampling_params import NOT_IMPLEMENTED, RULES
from airserve.srt.tokenizer import Tokenizer
from airserve_testing.tiny_models import build_tokenizer

LIMITS = RequestLimits(vocab_size=300, context_length=512, max_prompt_chars=1000)
INTS = ("max_new_tokens", "min_new_tokens", "top_k", "seed", "stream_interval")
FLOATS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
          "repetition_penalty")
BOOLS = ("ignore_eos", "skip_special_tokens")


def field_error(params: dict, field: str) -> str:
    with pytest.raises(FieldError) as e:
        SamplingParams.from_dict(params)
    assert e.value.field == field and str(e.value).startswith(field + ":"), str(e.value)
    return str(e.value)


GRAMMARS = ("json_schema", "regex", "ebnf")


def test_every_rule_is_exercised_here():
    assert set(RULES) == set(INTS + FLOATS + BOOLS + GRAMMARS
                             + ("stop", "stop_token_ids", "logit_bias"))


def test_logit_bias_keys_values_and_vocabulary():
    params = SamplingParams.from_dict({"logit_bias": {"5": 100, 7: -100.0, "0": 0.5}})
    assert params.logit_bias == {5: 100.0, 7: -100.0, 0: 0.5}
    for bad in ({"5": 100.5}, {"5": math.nan}, {"5": True}, {"-1": 1}, {"a": 1}, {"5.0": 1},
                [5], "5"):
        with pytest.raises(FieldError) as e:
            SamplingParams.from_dict({"logit_bias": bad})
        assert e.value.field.startswith("logit_bias"), str(e.value)
    with pytest.raises(FieldError, match="not in the vocabulary"):
        validate_request([1, 2], {"logit_bias": {"300": 1}}, LIMITS)
    assert validate_request([1, 2], {"logit_bias": {"299": 1}}, LIMITS).logit_bias == {299: 1}


def test_logprob_fields():
    assert parse_logprob({"return_logprob": False, "top_logprobs_num": 3}, 5, 1) is None
    lp = parse_logprob({"return_logprob": True, "top_logprobs_num": 3}, 5, 1)
    assert (lp.top_logprobs_num, lp.start(5)) == (3, 4)
    assert parse_logprob({"return_logprob": True, "logprob_start_len": 0}, 5, 1).start(5) == 0
    for body, field in [({"return_logprob": 1}, "return_logprob"),
                        ({"return_logprob": True, "top_logprobs_num": 101}, "top_logprobs_num"),
                        ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
                        ({"return_logprob": True, "logprob_start_len": 5}, "logprob_start_len")]:
        with pytest.raises(FieldError) as e:
            parse_logprob(body, 5, 1)
        assert e.value.field == field
    with pytest.raises(FieldError, match="max_new_tokens"):
        parse_logprob({"return_logprob": True, "logprob_start_len": 0}, 5, 0)
    assert parse_logprob({"return_logprob": True}, 5, 0).start(5) == 4  # nothing to compute


@pytest.mark.parametrize("name", GRAMMARS)
@pytest.mark.parametrize("value", ["", 1, True, {"type": "object"}, ["a"]])
def test_grammar_fields_must_be_non_empty_strings(name, value):
    assert "must be a non-empty string" in field_error({name: value}, name)


def test_one_grammar_per_request():
    assert "only one constraint" in field_error({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf")
    assert SamplingParams.from_dict({"regex": "a+", "json_schema": None}).regex == "a+"
    with pytest.raises(FieldError, match="sampling_params.regex: cannot be compiled"):
        validate_request([1, 2], {"regex": "(a"}, LIMITS)


@pytest.mark.parametrize("name", INTS)
@pytest.mark.parametrize("value", [True, False, 1.0, "3", [1], {}, 2**63, 10**400])
def test_integer_fields_refuse_other_types_and_huge_values(name, value):
    message = field_error({name: value}, name)
    assert "must be an integer in [" in message


def test_integer_ranges_are_named():
    assert "[0, 9223372036854775807]" in field_error({"seed": 2**64}, "seed")
    assert "an integer of 65 bits" in field_error({"seed": 2**64}, "seed")
    assert "[0, 2147483647]" in field_error({"max_new_tokens": 2**31}, "max_new_tokens")
    assert "[1, " in field_error({"stream_interval": 0}, "stream_interval")
    field_error({"top_k": -2}, "top_k")
    assert SamplingParams.from_dict({"top_k": -1, "seed": 2**63 - 1}).seed == 2**63 - 1


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True, "1", [0.5]])
def test_float_fields_need_finite_numbers(name, value):
    assert "must be a finite number in" in field_error({name: value}, name)


@pytest.mark.parametrize("name,inside,outside", [
    ("temperature", [0, 0.0, 1e-40, 1e6], [-1e-9]),
    ("top_p", [1e-9, 1], [0, 1.0000001]),
    ("min_p", [0, 1], [-1e-9, 1.5]),
    ("frequency_penalty", [-2, 2], [-2.1, 2.1]),
    ("presence_penalty", [-2, 2.0], [3]),
    ("repetition_penalty", [1e-9, 2], [0, 2.5]),
])
def test_float_ranges(name, inside, outside):
    for v in inside:
        assert getattr(SamplingParams.from_dict({name: v}), name) == float(v)
        assert type(getattr(SamplingParams.from_dict({name: v}), name)) is float
    for v in outside:
        field_error({name: v}, name)


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize("value", [0, 1, "true", [True]])
def test_bool_fields_need_true_or_false(name, value):
    assert "must be true or false" in field_error({name: value}, name)


@pytest.mark.parametrize("value", ["", [""], [1], ["a"] * 65, {"a": 1}, 3])
def test_stop_strings(value):
    field_error({"stop": value}, "stop")


@pytest.mark.parametrize("value", [[-1], [True], [1.0], ["1"], 5, [2**31]])
def test_stop_token_ids(value):
    field_error({"stop_token_ids": value}, "stop_token_ids")


@pytest.mark.parametrize("name", sorted(NOT_IMPLEMENTED))
def test_unimplemented_fields_are_refused_when_set_and_accepted_as_no_ops(name):
    message = field_error({name: {"x": 1}}, name)
    assert "not supported" in message
    params = SamplingParams.from_dict({name: None})
    for noop in NOT_IMPLEMENTED[name]:
        assert SamplingParams.from_dict({name: noop}) == params


def test_n_is_refused_above_one_and_true_is_not_one():
    field_error({"n": 2}, "n")
    field_error({"n": True}, "n")  # True == 1 in Python, but it is not the number 1
    assert SamplingParams.from_dict({"n": 1}) == SamplingParams()


def test_min_new_tokens_cannot_exceed_max_new_tokens():
    field_error({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens")


def test_prefix_names_the_field_in_its_request():
    with pytest.raises(FieldError, match=r"^sampling_params\.1\.top_p: "):
        SamplingParams.from_dict({"top_p": 2}, prefix="sampling_params.1.")
    with pytest.raises(FieldError, match="^sampling_params: must be an object"):
        SamplingParams.from_dict([1], prefix="sampling_params.")


# Request-level checks.
def test_validate_request_checks_vocabulary_stop_ids_and_context():
    assert validate_request([1, 2], {"max_new_tokens": 4}, LIMITS).max_new_tokens == 4
    for ids in ([300], [-1], [True], [1.0], "12", None):
        with pytest.raises(FieldError, match=r"^input_ids: .*\[0, 300\)"):
            validate_request(ids, {}, LIMITS)
    with pytest.raises(FieldError, match="^stop_token_ids: "):
        validate_request([1], {"stop_token_ids": [300]}, LIMITS)
    with pytest.raises(FieldError, match="context length of 512"):
        validate_request([1] * 500, {"max_new_tokens": 13}, LIMITS)
    validate_request([1] * 500, {"max_new_tokens": 12}, LIMITS)
    with pytest.raises(FieldError, match="empty"):
        check_fits(0, 1, LIMITS)


def test_text_checks():
    assert check_text("héllo", "prompt", LIMITS) == "héllo"
    with pytest.raises(FieldError, match="^prompt: must be a string"):
        check_text(5, "prompt", LIMITS)
    with pytest.raises(FieldError, match="^prompt: holds a lone UTF-16 surrogate"):
        check_text("ok \udc80", "prompt", LIMITS)
    with pytest.raises(FieldError, match="^text.2: has 1001 characters"):
        check_text("a" * 1001, "text.2", LIMITS)


def test_json_content_checks_depth_and_surrogates_with_a_path():
    check_json_value({"a": [[{"b": "ok"}]] * 3, "ids": list(range(1000))})
    deep: list = []
    node = deep
    for _ in range(40):
        node.append([])
        node = node[0]
    with pytest.raises(FieldError, match="nested more than 32 levels"):
        check_json_value({"x": deep})
    with pytest.raises(FieldError, match=r"^messages\.0\.content: holds a lone"):
        check_json_value({"messages": [{"content": "\ud83d"}]})
    with pytest.raises(FieldError, match="surrogate"):
        check_json_value({"k\udfff": 1})


# The character bound that refuses a huge prompt before tokenizing it must never refuse a
# prompt that fits: tokens * max_chars_per_token >= characters, for any text.
@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer(300), bos_token_id=None, eos_token_ids=[],
                     add_bos_token=False, chat_template=None, path="tiny")


@settings(max_examples=300, deadline=None)
@given(text=st.text(min_size=1, max_size=200))
def test_character_bound_never_undercounts_tokens(tokenizer, text):
    chars = max_chars_per_token(tokenizer)
    assert chars is not None and chars >= 1
    assert len(tokenizer.encode(text)) * chars >= len(text)


def test_long_texts_encode_like_short_ones(tokenizer):
    text = "Héllo wörld, the quick brown fox. " * 400  # above the GIL-free threshold
    assert tokenizer.encode(text) == tokenizer.tokenizer.encode(text).ids
