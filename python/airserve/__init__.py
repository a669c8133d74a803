"""airserve: an SGLang-style serving engine built around per-batch-size decode graph runners."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Engine", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import airserve` stays cheap and never imports torch or a vendor backend.
    if name == "Engine":
        from airserve.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)
