"""Where the scheduler's steps spend their time, by batch composition.

Every step is one of: `decode` (running requests only), `prefill` (prompt rows only) or
`mixed` (a prefill chunk plus the running requests as one-token extends). For each kind and
each band of decode rows, `StepSpans` adds up the steps, their rows and prompt tokens, and
three perf_counter spans: `schedule` (next_batch with its batch build), `forward` (the model
runner, sampling excluded) and `process` (sampling, stop checks, bookkeeping). The report
rides in the scheduler stats (`/get_server_info` -> `stats.step_spans`); two snapshots
subtract with `diff` to give one workload's share.
"""

from __future__ import annotations

# Decode-row bands a report groups steps by: 0, 1-4, 5-8, 9-16, 17-32, 33+.
ROW_BANDS = (0, 4, 8, 16, 32)
SPANS = ("schedule_s", "forward_s", "process_s")
FIELDS = ("steps", "decode_rows", "prefill_rows", "prefill_tokens") + SPANS


def band(decode_rows: int) -> str:
    """The report key of a step with `decode_rows` running requests in it."""
    if decode_rows == 0:
        return "0"
    low = 1
    for high in ROW_BANDS[1:]:
        if decode_rows <= high:
            return f"{low}-{high}"
        low = high + 1
    return f"{low}+"


def step_kind(decode_rows: int, prefill_rows: int) -> str:
    if prefill_rows and decode_rows:
        return "mixed"
    return "prefill" if prefill_rows else "decode"


class StepSpans:
    """Running sums per (kind, decode-row band); cheap enough to stay on."""

    def __init__(self) -> None:
        self.sums: dict[str, dict[str, dict[str, float]]] = {}

    def record(self, decode_rows: int, prefill_rows: int, prefill_tokens: int,
               schedule_s: float, forward_s: float, process_s: float) -> None:
        kind = step_kind(decode_rows, prefill_rows)
        entry = self.sums.setdefault(kind, {}).setdefault(
            band(decode_rows), dict.fromkeys(FIELDS, 0))
        for key, value in zip(FIELDS, (1, decode_rows, prefill_rows, prefill_tokens,
                                       schedule_s, forward_s, process_s)):
            entry[key] += value

    def report(self) -> dict:
        """{kind: {band: {steps, decode_rows, prefill_rows, prefill_tokens, *_s}}} (a copy)."""
        return {k: {b: dict(e) for b, e in bands.items()} for k, bands in self.sums.items()}


def diff(after: dict, before: dict) -> dict:
    """What two `report()` snapshots differ by: the steps taken between them."""
    out: dict = {}
    for kind, bands in after.items():
        for key, entry in bands.items():
            old = before.get(kind, {}).get(key, {})
            delta = {f: entry[f] - old.get(f, 0) for f in FIELDS}
            if delta["steps"]:
                out.setdefault(kind, {})[key] = delta
    return out


def summary(report: dict) -> list[dict]:
    """One row per (kind, band): steps, mean rows / tokens, and mean ms of each span."""
    rows = []
    for kind in ("decode", "prefill", "mixed"):
        for key, e in sorted(report.get(kind, {}).items(), key=lambda kv: _band_low(kv[0])):
            n = e["steps"]
            rows.append({"kind": kind, "decode_rows": key, "steps": n,
                         "mean_decode_rows": round(e["decode_rows"] / n, 1),
                         "mean_prefill_tokens": round(e["prefill_tokens"] / n, 1),
                         **{s.replace("_s", "_ms"): round(1000 * e[s] / n, 1) for s in SPANS}})
    return rows


def _band_low(key: str) -> int:
    return int(key.split("-")[0].rstrip("+"))
