"""Bucket schedule: SGLang-like defaults, the max always included, capped by running requests."""

from __future__ import annotations

from airserve.srt.model_executor.graph_runners.base import (
    DEFAULT_CUDA_GRAPH_MAX_BS,
    default_buckets,
    get_batch_size_buckets,
    power_of_two_buckets,
)
from airserve.srt.server_args import ServerArgs


def test_default_schedule_matches_sglang():
    assert default_buckets(48) == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48]


def test_max_is_always_included():
    # SGLang #21005: a max that is not on the schedule must still be captured.
    assert default_buckets(20) == [1, 2, 4, 8, 12, 16, 20]
    assert default_buckets(3) == [1, 2, 3]
    assert default_buckets(1) == [1]


def test_cuda_graph_max_bs_and_default():
    assert get_batch_size_buckets(ServerArgs(cuda_graph_max_bs=24), 128)[-1] == 24
    assert get_batch_size_buckets(ServerArgs(), 1000)[-1] == DEFAULT_CUDA_GRAPH_MAX_BS


def test_compile_runners_use_torch_compile_max_bs():
    args = ServerArgs(cuda_graph_max_bs=64, torch_compile_max_bs=8)
    assert get_batch_size_buckets(args, 128, compile_runner=True) == [1, 2, 4, 8]
    assert get_batch_size_buckets(args, 128)[-1] == 64


def test_never_above_max_running_requests():
    assert get_batch_size_buckets(ServerArgs(cuda_graph_max_bs=64), 10) == [1, 2, 4, 8, 10]
    args = ServerArgs(torch_compile_max_bs=32)
    assert get_batch_size_buckets(args, 6, compile_runner=True) == [1, 2, 4, 6]


def test_cuda_graph_bs_overrides():
    args = ServerArgs(cuda_graph_bs=(16, 1, 3, 3))
    assert get_batch_size_buckets(args, 128) == [1, 3, 16]
    assert get_batch_size_buckets(args, 128, compile_runner=True) == [1, 3, 16]
    # Sizes above the running-request limit are dropped (and logged).
    assert get_batch_size_buckets(args, 8) == [1, 3]


def test_power_of_two_schedule_for_cpu_compiles():
    assert power_of_two_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert power_of_two_buckets(12) == [1, 2, 4, 8, 12]
    args = ServerArgs(torch_compile_max_bs=16)
    assert get_batch_size_buckets(args, 128, compile_runner=True,
                                  schedule=power_of_two_buckets) == [1, 2, 4, 8, 16]
