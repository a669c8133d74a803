"""Requests whose grammar is still compiling: they join the waiting queue once it is ready.

Compilation runs in the grammar backend's worker thread, so a scheduler step never waits on
it; a cached grammar is ready at once. A grammar that fails to compile fails its request (400).
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait

from airserve.srt.constrained.backend import GrammarBackend
from airserve.srt.constrained.spec import grammar_of
from airserve.srt.managers.req import Req


class GrammarQueue:
    def __init__(self, backend: GrammarBackend | None) -> None:
        self.backend = backend
        self.pending: list[Req] = []

    def needs_grammar(self, req: Req) -> bool:
        return grammar_of(req.sampling_params) is not None

    def add(self, req: Req) -> None:
        """Start compiling `req`'s grammar (ValueError when this engine has no backend)."""
        if self.backend is None:
            raise ValueError("this engine was built without a grammar backend; structured "
                             "output is not available")
        req.grammar_future = self.backend.submit(grammar_of(req.sampling_params))
        self.pending.append(req)

    def pop_done(self) -> tuple[list[Req], list[tuple[Req, Exception]]]:
        """(requests now ready, each with its matcher; (request, error) for failed ones)."""
        ready, failed, still = [], [], []
        for req in self.pending:
            future = req.grammar_future
            if not future.done():
                still.append(req)
                continue
            req.grammar_future = None
            try:
                req.grammar = self.backend.matcher(future.result())
                ready.append(req)
            except Exception as e:  # noqa: BLE001 - the request's grammar (or ours) failed
                failed.append((req, e))
        self.pending = still
        return ready, failed

    def remove(self, rid: str) -> Req | None:
        for req in self.pending:
            if req.rid == rid:
                self.pending.remove(req)
                return req
        return None

    def wait(self, timeout: float) -> None:
        """Block until one pending grammar is compiled, at most `timeout` s."""
        futures = [r.grammar_future for r in self.pending]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def __len__(self) -> int:
        return len(self.pending)
