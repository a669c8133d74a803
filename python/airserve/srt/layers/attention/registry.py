"""Attention backends by name, imported on first use; the names feed --attention-backend.

Adding a backend is its file plus one line in `ATTENTION_BACKENDS`. A backend subclasses
`AttentionBackend` (base.py) and is built as `Backend(allocator, max_context_len)`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from airserve.srt.layers.attention.base import AttentionBackend
    from airserve.srt.mem_cache.memory_pool import PagedAllocator

_PKG = "airserve.srt.layers.attention"
# Backend name -> (module, class), imported lazily (ascend imports torch_npu on first use).
ATTENTION_BACKENDS = {
    "torch_native": (f"{_PKG}.torch_native_backend", "TorchNativeAttnBackend"),
    "ascend": (f"{_PKG}.ascend_backend", "AscendAttnBackend"),
}
# The backend each device gets when --attention-backend is not given.
DEFAULT_ATTENTION_BACKEND = {"cpu": "torch_native", "cuda": "torch_native", "npu": "ascend"}


def create_attention_backend(name: str, allocator: PagedAllocator,
                             context_len: int) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {name!r} is unknown; use "
                         f"{' or '.join(ATTENTION_BACKENDS)}")
    module_name, class_name = ATTENTION_BACKENDS[name]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(allocator, context_len)


# Page sizes a backend's kernels take: (a multiple of, at most). FIA's page attention (ascend
# decode) takes a block size that is a multiple of 16 and at most 512.
PAGE_SIZE_LIMITS = {"ascend": (16, 512)}


def check_page_size(backend: str, page_size: int) -> None:
    """Raise a ValueError naming --page-size if `backend` cannot run pages of `page_size`."""
    if backend not in PAGE_SIZE_LIMITS:
        return
    align, most = PAGE_SIZE_LIMITS[backend]
    if page_size % align or page_size > most:
        raise ValueError(f"--page-size {page_size}: the {backend} attention backend (FIA page "
                         f"attention) needs a multiple of {align} no larger than {most} "
                         "(128 is the default on npu)")
