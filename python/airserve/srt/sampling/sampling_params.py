"""Per-request sampling parameters (SGLang's names) and the rule each field must meet.

`SamplingParams.from_dict` is the only way a request's parameters are built: every field is
checked by type and range (a bool is not a number, numbers are finite, integers fit the
engine's types) and an error names the field and what it accepts. Request-level checks that
need the model (vocabulary, context length) are in `airserve.srt.managers.validation`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1  # torch.Generator seeds are 64-bit
MAX_STOP_STRINGS = 64  # every stop string is matched after every step

# SGLang sampling fields airserve does not implement -> the values that ask for nothing (null
# is always fine). Any other value would change the output, so the request is refused.
NOT_IMPLEMENTED: dict[str, tuple] = {
    "structural_tag": (), "stop_regex": (),
    "custom_params": ({},), "n": (1,), "no_stop_trim": (False,),
    "spaces_between_special_tokens": (True,), "sampling_seed_offset": (0,),
}
# Grammars that constrain the output (airserve.srt.constrained); at most one per request.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
# Accepted and checked, with no effect on the output: every step is streamed anyway.
NO_EFFECT = frozenset({"stream_interval"})


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of a request's `sample`-th sample (n > 1): samples with one seed would all be
    equal, so it is offset per sample (wrapping within the 64-bit range)."""
    return None if seed is None else (seed + sample) % (INT64_MAX + 1)


class FieldError(ValueError):
    """A request field is missing, of the wrong type or out of range; `field` names it."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field


def show(value: object) -> str:
    """A short, always printable form of a request value for error messages."""
    if isinstance(value, bool) or value is None:
        return "true" if value is True else "false" if value is False else "null"
    if isinstance(value, int):
        bits = value.bit_length()
        return repr(value) if bits <= 64 else f"an integer of {bits} bits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:40] + "...")
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} items"
    return f"a {type(value).__name__}" if not isinstance(value, dict) else "an object"


def expect_int(name: str, value: object, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise FieldError(name, f"must be an integer in [{low}, {high}], got {show(value)}")
    return value


def expect_float(name: str, value: object, low: float = -math.inf, high: float = math.inf,
                 low_open: bool = False) -> float:
    """A finite number (an int is fine, a bool is not) in [low, high] (or (low, high])."""
    ok = type(value) in (int, float) and math.isfinite(value)
    ok = ok and (low < value if low_open else low <= value) and value <= high
    if not ok:
        bounds = f"{'(' if low_open else '['}{_num(low)}, {_num(high)}]"
        raise FieldError(name, f"must be a finite number in {bounds}, got {show(value)}")
    return float(value)


def expect_bool(name: str, value: object) -> bool:
    if type(value) is not bool:
        raise FieldError(name, f"must be true or false, got {show(value)}")
    return value


def expect_stop(name: str, value: object) -> list[str]:
    strings = [value] if isinstance(value, str) else value
    if not (isinstance(strings, list) and len(strings) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and s for s in strings)):
        raise FieldError(name, f"must be a non-empty string or a list of at most "
                               f"{MAX_STOP_STRINGS} of them, got {show(value)}")
    return list(strings)


def expect_token_ids(name: str, value: object) -> list[int]:
    if not (isinstance(value, list) and all(type(t) is int and 0 <= t <= INT32_MAX
                                            for t in value)):
        raise FieldError(name, f"must be a list of token ids (integers >= 0), got {show(value)}")
    return value


def expect_grammar(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise FieldError(name, f"must be a non-empty string (the grammar's source), got "
                               f"{show(value)}")
    return value


def refuse_not_implemented(values: Mapping, table: Mapping[str, tuple], prefix: str = "") -> None:
    """Refuse every field of `table` that `values` sets to anything but null or a no-op."""
    bad = [name for name, noop in table.items()
           if values.get(name) is not None and not _is_one_of(values[name], noop)]
    if bad:
        names = ", ".join(prefix + name for name in bad)
        raise FieldError(prefix + bad[0], f"not supported by airserve (it would change the "
                                          f"output); leave it out of the request: {names}")


def _is_one_of(value: object, options: tuple) -> bool:
    return any(type(value) is type(o) and value == o for o in options)


def _num(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and x == int(x) else str(x)


MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: +-100 bans or forces a token


def expect_logit_bias(name: str, value: object) -> dict[int, float]:
    """{token id: bias}; the id as an integer or its decimal string (JSON keys are strings),
    the bias in [-100, 100]. The ids are checked against the vocabulary with the request."""
    if not isinstance(value, Mapping):
        raise FieldError(name, f"must be an object mapping token ids to biases, got "
                               f"{show(value)}")
    bias: dict[int, float] = {}
    for key, b in value.items():
        token = key if type(key) is int else int(key) if isinstance(key, str) and \
            key.isascii() and key.isdigit() and len(key) <= 10 else None
        if token is None or not 0 <= token <= INT32_MAX:
            raise FieldError(name, f"keys must be token ids (integers >= 0), got {show(key)}")
        bias[token] = expect_float(f"{name}.{key}", b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return bias


_Check = Callable[[str, object], object]
# Field -> check: returns the value to store, or raises FieldError naming the field.
RULES: dict[str, _Check] = {
    "max_new_tokens": lambda n, v: expect_int(n, v, 0, INT32_MAX),
    "min_new_tokens": lambda n, v: expect_int(n, v, 0, INT32_MAX),
    "temperature": lambda n, v: expect_float(n, v, 0.0),
    "top_p": lambda n, v: expect_float(n, v, 0.0, 1.0, low_open=True),
    "top_k": lambda n, v: v if v == -1 and type(v) is int else expect_int(n, v, 0, INT32_MAX),
    "min_p": lambda n, v: expect_float(n, v, 0.0, 1.0),
    "frequency_penalty": lambda n, v: expect_float(n, v, -2.0, 2.0),
    "presence_penalty": lambda n, v: expect_float(n, v, -2.0, 2.0),
    "repetition_penalty": lambda n, v: expect_float(n, v, 0.0, 2.0, low_open=True),
    "stop": expect_stop,
    "stop_token_ids": expect_token_ids,
    "ignore_eos": expect_bool,
    "skip_special_tokens": expect_bool,
    "seed": lambda n, v: expect_int(n, v, 0, INT64_MAX),
    "stream_interval": lambda n, v: expect_int(n, v, 1, INT32_MAX),
    "logit_bias": expect_logit_bias,
    **{name: expect_grammar for name in GRAMMAR_FIELDS},
}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    # Added to the logits before sampling (after penalties); logprobs do not see it.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # At most one: the output must match this grammar (checked by airserve.srt.constrained).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @classmethod
    def from_dict(cls, d: Mapping | None, prefix: str = "") -> SamplingParams:
        """Build and validate. A null field takes its default; an unknown, ill-typed, out of
        range or unimplemented field raises FieldError (a ValueError) naming it as
        `prefix + name`."""
        if d is None:
            d = {}
        if not isinstance(d, Mapping):
            raise FieldError(prefix.rstrip(".") or "sampling_params",
                             f"must be an object, got {show(d)}")
        unknown = sorted(k for k in d if k not in RULES and k not in NOT_IMPLEMENTED)
        if unknown:
            raise FieldError(prefix + str(unknown[0]), "unknown sampling parameter; known: "
                             + ", ".join(sorted(RULES)))
        refuse_not_implemented(d, NOT_IMPLEMENTED, prefix)
        values = {k: RULES[k](prefix + k, v) for k, v in d.items() if k in RULES and v is not None}
        for name in NO_EFFECT:
            values.pop(name, None)
        params = cls(**values)
        if params.min_new_tokens > params.max_new_tokens:
            raise FieldError(prefix + "min_new_tokens",
                             f"must be <= max_new_tokens ({params.max_new_tokens}), got "
                             f"{params.min_new_tokens}")
        grammars = [name for name in GRAMMAR_FIELDS if getattr(params, name) is not None]
        if len(grammars) > 1:
            raise FieldError(prefix + grammars[1], "only one constraint per request: "
                             + " and ".join(grammars) + " are both set")
        return params

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.frequency_penalty != 0 or self.presence_penalty != 0
                or self.repetition_penalty != 1)
