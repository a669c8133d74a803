"""The `isa` fixture of the C++ attention operators' tests: each test runs once per instruction
set the operators have (avx512, avx2, scalar), narrowed with `use_attention_isa`, skipped where
this CPU lacks one or the kernels are not built."""

from __future__ import annotations

import pytest

from airserve.srt.layers import cpu_kernels
from airserve.srt.layers.attention import torch_native_backend as tnb


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request):
    if not cpu_kernels.available():
        pytest.skip(f"C++ kernels not built: {cpu_kernels.unavailable_reason()}")
    if request.param not in tnb.attention_isas():
        pytest.skip(f"this CPU lacks {request.param}")
    tnb.use_attention_isa(request.param)
    yield request.param
    tnb.use_attention_isa("auto")
