"""Property-based fuzzing of the three generation endpoints against the live server.

Each case starts from a valid request and replaces a few fields (known ones and made-up ones)
with random JSON: wrong types, extreme numbers, odd strings, nested values. Whatever is sent,
the server answers with a status below 500 and an error body naming the problem, and after
every case `/health` answers and a short greedy request still gives its reference output.

A second test sends every field, one at a time, every value of a short list of extremes.
`AIRSERVE_FUZZ_EXAMPLES` sets the number of random cases per endpoint (scripts/fuzz_http.py runs
many more than the default 40).
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Set by scripts/fuzz_http.py, which also picks a random seed; the suite's own run is fixed.
EXAMPLES = int(os.environ.get("AIRSERVE_FUZZ_EXAMPLES", "40"))
REPRODUCIBLE = "AIRSERVE_FUZZ_EXAMPLES" not in os.environ
GREEDY = {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 4,
                                                             "temperature": 0}}

EXTREME_INTS = [0, 1, -1, 2, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64,
                -2**63, -2**63 - 1, 10**30, -10**30, 511, 512, 513]
EXTREME_FLOATS = [0.0, -0.0, 1e-40, -1e-40, 5e-324, 1e-7, 0.5, 1.0, 1.0000001, 2.0, 2.0000001,
                  -2.0, 1e38, 3.5e38, 1e308, -1e308, 0.9999999]
scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EXTREME_INTS), st.integers(-3, 40),
    st.sampled_from(EXTREME_FLOATS), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12), st.sampled_from(["", "\u0000", "\ud800", "\udfff", "é" * 5, "[]",
                                           "default", "text", "auto", "none", "1"]),
)
INT_FIELDS = {"max_new_tokens", "min_new_tokens", "top_k", "seed", "n", "stream_interval",
              "max_tokens", "max_completion_tokens", "min_tokens", "top_logprobs", "best_of",
              "logprobs", "top_logprobs_num", "logprob_start_len"}
FLOAT_FIELDS = {"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                "repetition_penalty"}
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=8)
ids = st.lists(st.one_of(st.integers(-2, 400), st.sampled_from(EXTREME_INTS)), max_size=6)

SAMPLING = ["max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
            "frequency_penalty", "presence_penalty", "repetition_penalty", "stop",
            "stop_token_ids", "ignore_eos", "skip_special_tokens", "seed", "n", "regex",
            "json_schema", "ebnf", "logit_bias", "no_stop_trim", "stream_interval",
            "spaces_between_special_tokens", "custom_params", "bogus_param"]
OPENAI = ["model", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
          "presence_penalty", "repetition_penalty", "n", "stop", "stop_token_ids", "seed",
          "stream", "stream_options", "ignore_eos", "min_tokens", "skip_special_tokens",
          "logit_bias", "logprobs", "top_logprobs", "echo", "suffix", "best_of", "tools",
          "tool_choice", "response_format", "max_tokens", "max_completion_tokens", "user",
          "regex", "json_schema", "chat_template_kwargs", "bogus_field"]

# (path, base body, top-level fields to fuzz)
ENDPOINTS = {
    "generate": ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 3}},
                 ["text", "input_ids", "stream", "rid", "sampling_params", "return_logprob",
                  "top_logprobs_num", "logprob_start_len", "return_text_in_logprobs",
                  "lora_path", "image_data", "log_metrics"]),
    "completions": ("/v1/completions", {"prompt": "Hello", "max_tokens": 3},
                    OPENAI + ["prompt"]),
    "chat": ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3},
             OPENAI + ["messages"]),
}


def values_for(name: str) -> st.SearchStrategy:
    """Mostly values of the field's own type (extremes included), sometimes any JSON."""
    if name in INT_FIELDS:
        typed = st.one_of(st.sampled_from(EXTREME_INTS), st.integers(0, 8))
    elif name in FLOAT_FIELDS:
        typed = st.one_of(st.sampled_from(EXTREME_FLOATS), st.floats(0, 2))
    else:
        return json_values
    return st.one_of(typed, typed, json_values)


@st.composite
def mutated(draw, endpoint: str) -> dict:
    path, base, fields = ENDPOINTS[endpoint]
    body = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        if endpoint == "generate" and draw(st.booleans()):
            name = draw(st.sampled_from(SAMPLING))
            params = body.get("sampling_params")
            if isinstance(params, dict):
                params[name] = draw(values_for(name))
            continue
        name = draw(st.sampled_from(fields))
        if name in ("input_ids", "prompt") and draw(st.booleans()):
            body[name] = draw(ids)
        elif name == "messages" and draw(st.booleans()):
            body[name] = [{"role": draw(st.sampled_from(["user", "system", "assistant", "x"])),
                           "content": draw(json_values)}]
        else:
            body[name] = draw(values_for(name))
    if endpoint == "generate" and "input_ids" in body and draw(st.booleans()):
        body.pop("text", None)
    return body


@pytest.fixture(scope="module")
def reference(server) -> list[int]:
    with server.client() as http:
        r = http.post("/generate", json=GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def check_case(http, reference: list[int], path: str, body: dict) -> None:
    # ensure_ascii keeps lone surrogates as \ud800 escapes: valid JSON the server must refuse.
    r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["code"] == r.status_code and error["message"], (body, r.text)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), (body, r.text)
        assert '"code": 5' not in r.text, (body, r.text)  # no server fault inside the stream
    assert http.get("/health").status_code == 200, body
    again = http.post("/generate", json=GREEDY)
    assert again.status_code == 200 and again.json()["output_ids"] == reference, body


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_fuzzed_requests_never_break_the_server(http, reference, endpoint):
    path = ENDPOINTS[endpoint][0]

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=REPRODUCIBLE,
              suppress_health_check=list(HealthCheck))
    @given(body=mutated(endpoint))
    def run(body):
        check_case(http, reference, path, body)

    run()


# Every field, one at a time, with every extreme value (the rest of the request is valid).
SWEEP_VALUES = [2**31, 2**64, True, 1e-40, 5e-324, 1e308, "\ud800", {"a": [1]}]


def sweep_cases() -> list[tuple[str, str, dict]]:
    cases = []
    for endpoint, (_, base, fields) in ENDPOINTS.items():
        targets = [(None, f) for f in fields]
        if endpoint == "generate":
            targets += [("sampling_params", f) for f in SAMPLING]
        for parent, name in targets:
            for value in SWEEP_VALUES:
                body = json.loads(json.dumps(base))
                (body[parent] if parent else body)[name] = value
                cases.append((endpoint, f"{parent + '.' if parent else ''}{name}", body))
    return cases


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_every_field_takes_every_extreme_value(http, reference, endpoint):
    cases = [c for c in sweep_cases() if c[0] == endpoint]
    path = ENDPOINTS[endpoint][0]
    last_field = None
    for _, field, body in cases:
        if field != last_field and last_field is not None:  # after each field's values
            check_case(http, reference, path, body)
        else:
            r = http.post(path, content=json.dumps(body), headers={"Content-Type":
                                                                    "application/json"})
            assert r.status_code < 500, (body, r.text)
        last_field = field
