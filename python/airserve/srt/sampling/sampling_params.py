"""Per-request sampling parameters (SGLang's names), validated once at the door."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# SGLang sampling fields that airserve accepts and ignores (clients send them, often as null).
IGNORED_FIELDS = frozenset({
    "regex", "json_schema", "ebnf", "structural_tag", "stop_regex", "no_stop_trim",
    "spaces_between_special_tokens", "custom_params", "logit_bias", "n", "sampling_seed_offset",
    "stream_interval",
})


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

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        """Build and validate; an unknown or ill-typed field raises ValueError naming it."""
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in names and k not in IGNORED_FIELDS)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        values = {k: v for k, v in d.items() if k in names and v is not None}
        if "stop" in values and isinstance(values["stop"], str):
            values["stop"] = [values["stop"]]
        params = cls(**values)
        params.validate()
        return params

    def validate(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}: {rule}")

        ints = ("max_new_tokens", "min_new_tokens", "top_k")
        for name in ints:
            need(isinstance(getattr(self, name), int) and not isinstance(getattr(self, name), bool),
                 name, "must be an integer")
        floats = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                  "repetition_penalty")
        for name in floats:
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool), name,
                 "must be a number")
        need(self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0")
        need(self.min_new_tokens >= 0, "min_new_tokens", "must be >= 0")
        need(self.temperature >= 0, "temperature", "must be >= 0")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(self.top_k == -1 or self.top_k >= 0, "top_k", "must be -1 (off) or >= 0")
        need(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        need(0 < self.repetition_penalty <= 2, "repetition_penalty", "must be in (0, 2]")
        need(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
             "stop", "must be a non-empty string or a list of them")
        need(isinstance(self.stop_token_ids, list)
             and all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids", "must be a list of token ids")
        need(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be true or false")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.frequency_penalty != 0 or self.presence_penalty != 0
                or self.repetition_penalty != 1)
