"""Compiled grammars for one model's vocabulary, and the per-request matcher.

`GrammarBackend.submit(spec)` compiles in a worker thread (never on the scheduler's step) and
keeps the compiled grammar in an LRU cache keyed by (kind, text): a schema sent again starts at
once. A request then holds a `GrammarState`: its matcher says which tokens may come next and
follows every token the request accepts.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from airserve.srt.constrained.spec import (
    MAX_JSON_WHITESPACE,
    GrammarSpec,
    clean_error,
    import_xgrammar,
    json_schema_source,
)

logger = logging.getLogger(__name__)

CACHE_ENTRIES = 256  # compiled grammars kept (a JSON schema's is tens of KB for a 50k vocab)


class GrammarError(ValueError):
    """A grammar does not compile: the request's fault (HTTP 400)."""


class GrammarBackend:
    """xgrammar for one tokenizer. `vocab_size` is the model's logits width (it may exceed the
    tokenizer's vocabulary: the extra ids are never allowed); `stop_token_ids` end a grammar."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 threads: int = 1) -> None:
        self.tokenizer = tokenizer  # airserve.srt.tokenizer.Tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="airserve-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._compiler = None  # built in the worker on first use (xgrammar imports slowly)
        self.stats = {"compiled": 0, "cache_hits": 0, "failed": 0}

    def submit(self, spec: GrammarSpec) -> Future:
        """A future of the compiled grammar (GrammarError if it does not compile)."""
        with self._lock:
            future = self._cache.get(spec)  # a failed compile stays cached too: it would fail again
            if future is not None:
                self._cache.move_to_end(spec)
                self.stats["cache_hits"] += 1
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return future

    def matcher(self, compiled) -> GrammarState:
        return GrammarState(import_xgrammar().GrammarMatcher(compiled))

    def report(self) -> dict:
        return {**self.stats, "cached": len(self._cache)}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GrammarSpec):
        compiler = self._get_compiler()
        try:
            if spec.kind == "json_schema":
                compiled = compiler.compile_json_schema(
                    json_schema_source(spec.text), max_whitespace_cnt=MAX_JSON_WHITESPACE)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.text)
            else:
                compiled = compiler.compile_grammar(spec.text)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and its own kinds
            self.stats["failed"] += 1
            raise GrammarError(f"{spec.kind}: cannot be compiled: {clean_error(e)}") from None
        self.stats["compiled"] += 1
        return compiled

    def _get_compiler(self):
        if self._compiler is None:  # only the (single) worker thread gets here
            xgr = import_xgrammar()
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.tokenizer)
            info = xgr.TokenizerInfo.from_huggingface(
                hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None)
            # Our LRU caches compiled grammars; xgrammar's own cache would hold them twice.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            logger.info("grammar backend ready (xgrammar, vocab %d, %s)", self.vocab_size,
                        info.vocab_type.name)
        return self._compiler


class GrammarState:
    """One request's matcher: its state follows the request's output tokens one by one."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.num_accepted = 0

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Set row `row` of `bitmask` [rows, ceil(vocab / 32)] int32 to the allowed tokens."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        """Advance by one sampled token; a token the mask forbade is a bug, never ignored."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} was sampled but the grammar does not allow it")
        self.num_accepted += 1

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()
