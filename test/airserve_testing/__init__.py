"""Helpers shared by airserve's tests: tiny models built in code, a decode driver, a server
process, reference kernels. Importable as `airserve_testing` (pytest's `pythonpath = ["test"]`)."""

from airserve_testing.decode_driver import (
    Requests,
    make_runner,
    q4_1_decode_op,
    random_prompts,
    replay_matches_eager,
    run_side_by_side,
    tiny_gguf_runners,
    zero_kv,
)

__all__ = ["Requests", "make_runner", "q4_1_decode_op", "random_prompts",
           "replay_matches_eager", "run_side_by_side", "tiny_gguf_runners", "zero_kv"]
