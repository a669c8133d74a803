"""Tokenizer (HF `tokenizer.json` or GGUF metadata), chat template and incremental decoding."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer as HFTokenizer

_SHORT_TEXT = 4096  # characters; longer texts are encoded without holding the GIL


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], add_bos_token: bool,
                 chat_template: str | None, path: str) -> None:
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.path = path
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= _SHORT_TEXT:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        else:  # the batch call releases the GIL while it works; the plain one holds it
            ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The prompt text; `tools` (OpenAI function definitions) go to the template as
        transformers passes them: templates without tool support ignore them."""
        if not self.chat_template:
            raise ValueError(
                f"the tokenizer at {self.path} has no chat template; use /v1/completions or "
                "/generate with a plain prompt"
            )
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            # As transformers renders templates: plain JSON (jinja's own escapes <, > and &).
            env.filters["tojson"] = _tojson
            self._template = env.from_string(self.chat_template)
        special = {}
        for name in ("bos_token", "eos_token"):
            tid = self.bos_token_id if name == "bos_token" else (self.eos_token_ids or (None,))[0]
            special[name] = self.tokenizer.id_to_token(tid) if tid is not None else ""
        extra = {"tools": tools} if tools else {}
        return self._template.render(messages=messages,
                                     add_generation_prompt=add_generation_prompt, **special,
                                     **extra)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_template_error(message: str):
    raise ValueError(f"chat template error: {message}")


@dataclass
class IncrementalDecoder:
    """Streams text for growing `ids` without ever splitting a multi-byte character.

    Decodes a small window of recent tokens twice (with and without the new ones) and emits the
    difference only when it does not end in an incomplete UTF-8 sequence (U+FFFD).
    """

    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""

    def step(self, ids: Sequence[int]) -> str:
        """Feed the full output ids so far; returns the newly completed text (maybe "")."""
        prefix = self.tokenizer.decode(ids[self.prefix_offset:self.read_offset],
                                       self.skip_special_tokens)
        full = self.tokenizer.decode(ids[self.prefix_offset:], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
            self.text += new
            return new
        return ""

    def flush(self, ids: Sequence[int]) -> str:
        """At the end of a request: emit whatever is left, replacement characters included."""
        prefix = self.tokenizer.decode(ids[self.prefix_offset:self.read_offset],
                                       self.skip_special_tokens)
        full = self.tokenizer.decode(ids[self.prefix_offset:], self.skip_special_tokens)
        new = full[len(prefix):]
        self.prefix_offset = self.read_offset = len(ids)
        self.text += new
        return new


def load_hf_tokenizer(path: str) -> Tokenizer:
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_file):
        raise FileNotFoundError(
            f"{path} has no tokenizer.json; pass --tokenizer-path pointing at a directory with one"
        )
    tok = HFTokenizer.from_file(tok_file)
    cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    template = cfg.get("chat_template")
    template_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.exists(template_file):
        with open(template_file) as f:
            template = f.read()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)

    def token_id(entry) -> int | None:
        if isinstance(entry, dict):
            entry = entry.get("content")
        return tok.token_to_id(entry) if entry else None

    eos_ids = []
    for source in (_read_json(os.path.join(path, "generation_config.json")).get("eos_token_id"),
                   _read_json(os.path.join(path, "config.json")).get("eos_token_id")):
        if source is not None:
            eos_ids = list(source) if isinstance(source, list) else [source]
            break
    if not eos_ids and token_id(cfg.get("eos_token")) is not None:
        eos_ids = [token_id(cfg.get("eos_token"))]
    return Tokenizer(tok, bos_token_id=token_id(cfg.get("bos_token")), eos_token_ids=eos_ids,
                     add_bos_token=bool(cfg.get("add_bos_token", False)),
                     chat_template=template, path=path)


def load_gguf_tokenizer(path: str) -> Tokenizer:
    from airserve.srt.model_loader.gguf_loader import load_gguf

    info = load_gguf(path).tokenizer_info
    eos = info.get("eos_token_id")
    return Tokenizer(info["tokenizer"], bos_token_id=info.get("bos_token_id"),
                     eos_token_ids=[eos] if eos is not None else [],
                     add_bos_token=bool(info.get("add_bos_token", False)),
                     chat_template=info.get("chat_template"), path=path)


def get_tokenizer(path: str | None) -> Tokenizer:
    """Tokenizer for a model path (HF directory or .gguf file); None means the default model."""
    from airserve.srt.model_loader.model_path import resolve_model_path

    path = resolve_model_path(path)
    if path.endswith(".gguf"):
        return load_gguf_tokenizer(path)
    return load_hf_tokenizer(path)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)
