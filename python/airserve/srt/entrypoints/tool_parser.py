"""Tool calls read back from generated text, whole or while it streams.

Formats, chosen from the chat template:

- hermes (Qwen2/Qwen2.5/Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number, after optional content.
- json (Llama 3): the whole answer is `{"name": ..., "parameters" | "arguments": {...}}`
  (optionally after `<|python_tag|>`; several separated by `;`).

Constrained outputs (`tool_choice` required or named) are JSON of a known shape and are read
by `calls_from_required` / `calls_from_named`. A call whose name is not one of the request's
tools, or whose arguments are not an object, is not a call: the text stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_dict(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function",
             "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def template_format(template: str | None) -> str:
    """hermes or json, from how the template writes calls."""
    return "hermes" if template and HERMES_OPEN in template else "json"


def _call(obj: object, names: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_tool_calls(text: str, fmt: str, names: tuple[str, ...]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished answer; no calls: the text is all content."""
    if fmt == "hermes":
        start = text.find(HERMES_OPEN)
        if start < 0:
            return text, []
        blocks = _HERMES_BLOCK.findall(text, start)
        tail = text.rfind(HERMES_CLOSE)
        rest = text[tail + len(HERMES_CLOSE):] if tail >= 0 else text[start:]
        if rest.lstrip().startswith(HERMES_OPEN):  # an unclosed last call (stopped at EOS)
            blocks.append(rest.lstrip()[len(HERMES_OPEN):])
        calls = [_call(_loads(b.strip()), names) for b in blocks]
        if not calls or None in calls:
            return text, []
        return text[:start].rstrip(), calls
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    parts = [_loads(p) for p in body.split(";")] if body.startswith("{") else []
    if not parts and body.startswith("["):
        parts = _loads(body) or []
    calls = [_call(p, names) for p in parts] if isinstance(parts, list) else []
    if not calls or None in calls:
        return text, []
    return "", calls


def calls_from_required(text: str, names: tuple[str, ...]) -> list[ToolCall]:
    """The array of calls a `required` grammar produced ([] if cut short)."""
    items = _loads(text)
    calls = [_call(i, names) for i in items] if isinstance(items, list) else []
    return [] if None in calls else calls


def calls_from_named(text: str, name: str) -> list[ToolCall]:
    """The arguments object a named-function grammar produced ([] if cut short)."""
    args = _loads(text)
    return [ToolCall(name, json.dumps(args, ensure_ascii=False))] if isinstance(args,
                                                                                 dict) else []


class ToolStreamParser:
    """Splits a growing answer into content deltas and tool calls as they complete.

    `feed(text, finished)` takes the cumulative text and returns (content delta, new calls).
    Text that may be the start of a call is held back until it is known not to be one.
    """

    def __init__(self, mode: str, fmt: str, names: tuple[str, ...],
                 name: str | None = None) -> None:
        self.mode, self.fmt, self.names, self.name = mode, fmt, names, name
        self.sent = 0  # content characters streamed
        self.calls: list[ToolCall] = []
        self.in_calls = mode != "auto"  # constrained output is all calls

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        if finished:
            return self._finish(text)
        if self.in_calls:
            return "", self._complete_hermes(text) if self.fmt == "hermes" else []
        safe = self._content_end(text)
        piece, self.sent = text[self.sent:safe], max(self.sent, safe)
        return piece, []

    def _content_end(self, text: str) -> int:
        """How much of `text` is surely content."""
        if self.fmt == "hermes":
            start = text.find(HERMES_OPEN)
            if start >= 0:
                self.in_calls = True
                return max(self.sent, len(text[:start].rstrip()))
            # Whitespace before a call is not content either: hold it until text follows.
            return max(self.sent, len(text[:len(text) - _partial_suffix(text, HERMES_OPEN)]
                                      .rstrip()))
        stripped = text.lstrip()
        if not stripped:
            return self.sent  # only whitespace so far: a call may still come
        if stripped[0] in "{[" or stripped.startswith(PYTHON_TAG) or (
                PYTHON_TAG.startswith(stripped)):
            self.in_calls = True
            return self.sent
        return len(text)

    def _complete_hermes(self, text: str) -> list[ToolCall]:
        blocks = _HERMES_BLOCK.findall(text)
        new = [_call(_loads(b.strip()), self.names) for b in blocks[len(self.calls):]]
        new = [c for c in new if c is not None]
        self.calls += new
        return new

    def _finish(self, text: str) -> tuple[str, list[ToolCall]]:
        content = ""
        if self.mode == "required":
            calls = calls_from_required(text, self.names)
        elif self.mode == "named":
            calls = calls_from_named(text, self.name)
        else:
            content, calls = parse_tool_calls(text, self.fmt, self.names)
        if not calls:  # no call after all (or cut short): all that is held back is content
            piece, self.sent = text[self.sent:], len(text)
            return piece, []
        sent = {(c.name, c.arguments) for c in self.calls}
        new = [c for c in calls if (c.name, c.arguments) not in sent]
        self.calls += new
        piece, self.sent = content[self.sent:], max(self.sent, len(content))
        return piece, new


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
