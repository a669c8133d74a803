"""Grammar-constrained generation in the offline Engine: eager and CPU graph runner, greedy and
sampled, retraction, compile failures and aborts while a grammar compiles."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from airserve import Engine
from airserve.srt.managers.engine_core import build_req
from airserve.srt.model_executor.graph_runners.cpu import CPUGraphRunner
from airserve.srt.sampling.sampling_params import SamplingParams

# A shape no random-weight model writes by chance: nested, typed, ranged, closed.
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "item": {"enum": ["apple", "pear", "fig"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                 "maxItems": 2},
        "paid": {"type": "boolean"},
        "ship": {"type": "object", "properties": {"zip": {"type": "string",
                                                          "pattern": "^[0-9]{5}$"}},
                 "required": ["zip"], "additionalProperties": False},
    },
    "required": ["id", "item", "paid", "ship"],
    "additionalProperties": False,
}
PROMPTS = ["Hello", "The quick brown fox", "Question: Natalia sold clips", "12345 +"]
WORD_RE = r"[a-z]{6,12}( [a-z]{6,12}){3}"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return Engine(model_path=tiny_llama_dir, max_total_tokens=4096, max_running_requests=8,
                  num_threads=1)


@pytest.fixture(scope="module")
def graph_engine(tiny_llama_dir):
    eng = Engine(model_path=tiny_llama_dir, max_total_tokens=4096, max_running_requests=4,
                 num_threads=1,
                 enable_torch_compile=True, cuda_graph_bs=[1, 4])
    assert isinstance(eng.model_runner.graph_runner, CPUGraphRunner)
    return eng


def valid_order(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, ORDER)
    return value


def test_unconstrained_output_is_not_the_schema(engine):
    out = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 60})
    for o in out:
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            valid_order(o["text"])


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_schema_outputs_validate_eager_and_graph(engine, graph_engine, temperature):
    params = {"temperature": temperature, "seed": 7, "max_new_tokens": 400,
              "json_schema": json.dumps(ORDER)}
    eager = engine.generate(PROMPTS, params)
    graph = graph_engine.generate(PROMPTS, params)
    for out in eager + graph:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        valid_order(out["text"])
    assert graph_engine.model_runner.graph_replays > 0
    if temperature == 0:  # the mask is applied outside the graph: same tokens as eager
        assert [o["output_ids"] for o in graph] == [o["output_ids"] for o in eager]


def test_pool_too_small_retracts_and_matchers_follow(tiny_llama_dir, engine):
    params = {"temperature": 0, "max_new_tokens": 60, "regex": WORD_RE}
    prompts = [p + " " + str(i) for i, p in enumerate(PROMPTS * 2)]
    solo = [engine.generate(p, params)["output_ids"] for p in prompts]
    small = Engine(model_path=tiny_llama_dir, max_total_tokens=128, page_size=4,
                   max_running_requests=8, num_threads=1)
    outs = small.generate(prompts, params)
    assert small.scheduler.stats["retractions"] > 0
    assert [o["output_ids"] for o in outs] == solo
    for o in outs:
        assert re.fullmatch(WORD_RE, o["text"]), o["text"]


def test_compile_failure_and_abort_in_the_grammar_queue(engine):
    """Past the front door (which parses grammars), the scheduler still fails a grammar that
    does not compile, as that request's error, and can abort one still compiling."""
    sched = engine.scheduler
    bad = build_req(engine.tokenizer, [5, 6, 7],
                    SamplingParams(max_new_tokens=4, ebnf="root ::= undefined_rule"))
    sched.add_request(bad)
    while not bad.finished:
        sched.step()
    assert bad.finished_reason["status_code"] == 400
    assert "ebnf" in bad.finished_reason["message"]
    slow = build_req(engine.tokenizer, [5, 6, 7],
                     SamplingParams(max_new_tokens=4, regex="[0-9]{2,9}x"))
    sched.add_request(slow)
    # A failed step fails what runs, not what waits for its grammar.
    sched.fail_unattributed("a step failed", [slow])
    assert not slow.finished and sched.grammar_queue.pending == [slow]
    assert sched.abort(slow.rid) and slow.finished_reason["type"] == "abort"
    assert not sched.has_work() or sched.step() is not None
    assert not sched.grammar_queue and not sched.running


def test_ignore_eos_still_ends_with_the_grammar(engine):
    out = engine.generate("Hello", {"temperature": 0, "max_new_tokens": 50,
                                    "regex": "(yes|no)!", "ignore_eos": True})
    assert out["text"] in ("yes!", "no!")
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_grammar_cache_hits(engine):
    before = dict(engine.core.grammar_backend.stats)
    for _ in range(3):
        engine.generate("Hi", {"temperature": 0, "max_new_tokens": 8, "regex": "[0-9]{4}"})
    after = engine.core.grammar_backend.stats
    assert after["compiled"] - before["compiled"] <= 1
    assert after["cache_hits"] - before["cache_hits"] >= 2


def test_length_bounded_strings_take_only_valid_utf8():
    """The grammar of a length-bounded string refuses invalid UTF-8 (overlong forms, encoded
    surrogates), which would decode to several U+FFFD and break maxLength, and takes every
    Unicode scalar value but quote, backslash and controls."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from airserve.srt.constrained.spec import json_schema_source

    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}},
              "required": ["s"], "additionalProperties": False}
    grammar = xgr.Grammar.from_json_schema(json_schema_source(json.dumps(schema)))

    def ok(inner: bytes) -> bool:
        return accepts(grammar, b'{"s": "' + inner + b'"}')

    for invalid in (b"\xf0\x80\x80\x80", b"\xf0\x8f\xbf\xbf", b"\xe0\x80\x80",
                    b"\xed\xa0\x80", b"\xc0\x80", b"\x01", b"\n"):
        assert not ok(b"a" + invalid), invalid
    for valid in ("a b!", "\u00e9\ud7ff\ue000", "\U0010ffff#[]", "~\u063e"):
        assert ok(valid.encode()), valid
    assert not ok(b"abcde") and not ok(b'a"') and not ok(b"a\\")


def test_length_bounded_strings_are_valid_json(engine):
    """xgrammar writes such strings without excluding control characters; airserve adds a
    pattern that does (constrained.spec.json_schema_source)."""
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8}},
        "required": ["name"], "additionalProperties": False}
    for temperature in (0, 1.0):
        outs = engine.generate(PROMPTS, {"temperature": temperature, "seed": 3,
                                         "max_new_tokens": 200, "json_schema": json.dumps(schema)})
        for out in outs:
            jsonschema.validate(json.loads(out["text"]), schema)  # strict: no raw controls
