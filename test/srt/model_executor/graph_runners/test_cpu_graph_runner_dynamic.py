"""CPUGraphRunner buckets share compiled graphs (batch dimension dynamic): one compile serves
every bucket on the same code path, and each bucket still equals eager.

Tiny GGUF model with Q4_0/Q4_1/Q8_0 layers and --packed-decode-max-bs 3: bucket 4 (above the
limit, float32 matmuls) gets one graph; buckets 1, 2 and 3 (packed kernels) take the other branch
of the model and share the other: bs 1 gets no static graph of its own. Two compiles for four
buckets, counted by dynamo itself.
"""

from __future__ import annotations

import pytest
import torch

from airserve.srt.model_executor.graph_runners.base import dynamo_graph_count
from airserve_testing import random_prompts, run_side_by_side, tiny_gguf_runners

ATOL = 1e-4  # float32 on both sides; inductor reorders reductions
PACKED_LIMIT = 3
BUCKETS = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    before = dynamo_graph_count()
    graph, eager, _ = tiny_gguf_runners(str(tmp_path_factory.mktemp("dynamic")), BUCKETS,
                                        PACKED_LIMIT, reference={})
    return graph, eager, dynamo_graph_count() - before


def test_buckets_on_one_path_share_one_compile(runners):
    graph, _, dynamo_compiles = runners
    gr = graph.graph_runner
    assert dynamo_compiles == 2  # dynamo's own count: one graph per code path
    report = gr.report()
    assert report["graphs_compiled"] == 2
    assert report["buckets_compiled"] == list(BUCKETS)
    assert gr.graphs[1] is gr.graphs[2] is gr.graphs[3]  # bs 1 shares: no static graph
    assert gr.graphs[3] is not gr.graphs[4]
    assert gr.graphs[3].symbolic  # compiled with a symbolic batch size
    assert gr.capture_args[1] != gr.capture_args[2]  # called with each bucket's batch


@pytest.mark.parametrize("bs", [1, 2, 3, 4])
def test_each_bucket_of_a_shared_graph_matches_eager(runners, bs):
    graph, eager, _ = runners
    gr = graph.graph_runner
    replays = gr.replay_count
    prompts = random_prompts(graph.model_config.vocab_size, [5, 17, 9, 12][:bs])
    lg, le, tg, te, reqs = run_side_by_side(graph, eager, prompts, steps=6)
    assert gr.replay_count == replays + 6
    torch.testing.assert_close(lg, le, atol=ATOL, rtol=0)
    assert torch.equal(tg, te)
    assert gr.bucket_for(bs) in gr.direct  # replayed without dynamo
    assert gr.recompiles_since_capture() == 0
    for r in reqs:
        r.release()
