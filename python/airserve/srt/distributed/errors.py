"""Errors of tensor parallelism, in a module without torch: the HTTP process imports them."""

from __future__ import annotations


class TensorParallelError(RuntimeError):
    """The tensor-parallel ranks cannot go on (a rank died, a collective failed or timed out);
    the server must exit."""
