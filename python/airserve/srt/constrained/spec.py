"""What a request's grammar is, and the check that it parses (before any model work).

A request asks for at most one of `json_schema`, `regex` or `ebnf` (SGLang's sampling fields).
`check_grammar` parses it without a tokenizer, so a bad grammar is a 400 in the HTTP process,
before the request reaches the scheduler; parse results are cached per (kind, text).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from airserve.srt.sampling.sampling_params import GRAMMAR_FIELDS, FieldError, SamplingParams

# JSON whitespace between tokens is free (`any_whitespace`) but at most this many characters
# in a row: a model that prefers spaces or newlines must still reach the end of the object.
MAX_JSON_WHITESPACE = 12
_CACHE_SIZE = 256
# One unescaped character of a JSON string, as a regex: a Unicode scalar value from U+0020 up,
# but quote and backslash. Listed, not negated: xgrammar 0.2.8's negated class also takes
# overlong 3- and 4-byte forms and UTF-8-encoded surrogates, invalid UTF-8 that decodes to
# several U+FFFD, so a string it counted as 8 characters reached the client as 11.
_JSON_STRING_CHAR = '[ -!#-\\[\\]-\ud7ff\ue000-\U0010ffff]'
# xgrammar's C++ errors start with "[time] file.cc:line: "; the client needs the rest.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+\.cc:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class GrammarSpec:
    """One grammar: `kind` is json_schema, regex or ebnf; `text` its source."""

    kind: str
    text: str


def grammar_of(params: SamplingParams) -> GrammarSpec | None:
    """The request's grammar, or None (SamplingParams allows at most one)."""
    for kind in GRAMMAR_FIELDS:
        text = getattr(params, kind)
        if text is not None:
            return GrammarSpec(kind, text)
    return None


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise RuntimeError("structured output needs the xgrammar package: pip install "
                           "xgrammar (airserve's install does)") from e
    return xgrammar


def clean_error(error: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    text = str(error).strip()
    return _CPP_PREFIX.sub("", text.splitlines()[0] if text else type(error).__name__)


def json_schema_source(text: str) -> str:
    """The schema xgrammar gets. xgrammar 0.2.8 writes a string with minLength / maxLength as
    any characters but quote, backslash, CR and LF, so raw control characters (invalid JSON)
    could appear: such strings get an equivalent pattern that excludes them (and escapes)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text  # xgrammar reports the syntax error
    return json.dumps(_with_safe_lengths(schema))


def _with_safe_lengths(node: object) -> object:
    if isinstance(node, list):
        return [_with_safe_lengths(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _with_safe_lengths(v) for k, v in node.items()}
    lengths = [out.get("minLength"), out.get("maxLength")]
    if any(isinstance(n, int) for n in lengths) and "pattern" not in out and "format" not in out:
        low, high = (n if isinstance(n, int) else "" for n in lengths)
        out["pattern"] = f"^{_JSON_STRING_CHAR}{{{low or 0},{high}}}$"
    return out


def check_grammar(spec: GrammarSpec, field: str) -> None:
    """Raise FieldError naming `field` when `spec` does not parse."""
    error = _parse_error(spec)
    if error is not None:
        raise FieldError(field, f"cannot be compiled as {spec.kind}: {error}")


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _parse_error(spec: GrammarSpec) -> str | None:
    xgr = import_xgrammar()
    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(json_schema_source(spec.text),
                                         max_whitespace_cnt=MAX_JSON_WHITESPACE)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        else:
            xgr.Grammar.from_ebnf(spec.text)
    except (RuntimeError, ValueError, TypeError) as e:
        return clean_error(e)
    return None
