"""An exception while processing one request fails that request only.

Faults are injected (a Scheduler subclass whose stop check raises for one rid, a runner wrapper
whose forward raises when one request is in the batch); the scheduler, sampler, KV pool and
model are the real ones. After every case: the other requests' greedy outputs equal their solo
runs, and every KV page and request slot is back.
"""

from __future__ import annotations

import pytest
import torch

from airserve import Engine
from airserve.srt.managers.engine_core import build_req, eos_token_ids, scheduler_config
from airserve.srt.managers.scheduler import Scheduler
from airserve.srt.sampling.sampling_params import SamplingParams

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
BAD = "bad"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return Engine(model_path=tiny_llama_dir, max_total_tokens=2048, page_size=4,
                  max_running_requests=8)


@pytest.fixture(scope="module")
def prompts(engine):
    g = torch.Generator().manual_seed(11)
    vocab = engine.model_runner.model_config.vocab_size
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (6, 19, 11, 25)]


@pytest.fixture(scope="module")
def solo(engine, prompts):
    return [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]


class StopCheckFails(Scheduler):
    """Raises in the stop check of request BAD once it has 3 tokens."""

    def _check_finished(self, req, token):
        if req.rid == BAD and len(req.output_ids) == 3:
            raise RuntimeError("injected fault in the stop check")
        return super()._check_finished(req, token)


class FaultyRunner:
    """The real model runner, but forward raises when `fails(batch)` says so."""

    def __init__(self, runner, fails) -> None:
        self._runner = runner
        self._fails = fails
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def forward(self, fb):
        self.calls += 1
        if self._fails(fb):
            raise RuntimeError("injected fault in the forward pass")
        return self._runner.forward(fb)


_made: list[Scheduler] = []


def make_scheduler(engine, cls=Scheduler) -> Scheduler:
    # Schedulers share the engine's KV pool: empty every earlier prefix cache, so that the new
    # one starts with every page free.
    for sched in [engine.scheduler, *_made]:
        sched.flush_cache()
    _made.append(cls(engine.model_runner, eos_token_ids(engine.model_runner, engine.tokenizer),
                     scheduler_config(engine.server_args)))
    return _made[-1]


def run(engine, sched, prompts, bad_index=1, bad_params=None):
    reqs = []
    for i, p in enumerate(prompts):
        params = bad_params if (i == bad_index and bad_params) else SamplingParams(**GREEDY)
        reqs.append(build_req(engine.tokenizer, p, params, rid=BAD if i == bad_index else str(i)))
        sched.add_request(reqs[-1])
    for _ in range(200):
        if all(r.finished for r in reqs):
            break
        sched.step()
    assert all(r.finished for r in reqs)
    return reqs


def assert_isolated(engine, sched, reqs, solo, status, stage):
    bad = next(r for r in reqs if r.rid == BAD)
    assert bad.finished_reason["type"] == "abort"
    assert bad.finished_reason["status_code"] == status
    assert stage in bad.finished_reason["message"]
    for req, want in zip(reqs, solo):
        if req is not bad:
            assert req.output_ids == want, req.rid
            assert req.finished_reason == {"type": "length", "length": GREEDY["max_new_tokens"]}
    alloc, pool = engine.model_runner.allocator, engine.model_runner.req_to_token_pool
    # No KV page leaked: every page is free or in the prefix cache (which can evict it).
    assert sched.kv.audit(sched.holders())["owned"] == 0
    assert sched.kv.available_pages() == alloc.total_usable_pages
    assert pool.available_size() == pool.size
    assert sched.stats["failed_requests"] == 1


def test_exception_in_one_requests_stop_check_fails_only_it(engine, prompts, solo):
    sched = make_scheduler(engine, StopCheckFails)
    reqs = run(engine, sched, prompts)
    assert_isolated(engine, sched, reqs, solo, 500, "processing its new token")
    assert len(next(r for r in reqs if r.rid == BAD).output_ids) == 3


@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_forward_failing_for_one_request_fails_only_it(engine, prompts, solo, mode):
    sched = make_scheduler(engine)
    bad_slot = []

    def fails(fb):
        slots = fb.req_pool_indices.tolist()
        return fb.forward_mode.name.lower() == mode and bool(set(slots) & set(bad_slot))

    sched.runner = FaultyRunner(engine.model_runner, fails)
    original = sched._build_extend

    def remember_bad_slot(reqs, locs):
        fb = original(reqs, locs)
        bad_slot.extend(r.req_pool_idx for r in reqs if r.rid == BAD)
        return fb

    sched._build_extend = remember_bad_slot
    reqs = run(engine, sched, prompts)
    assert_isolated(engine, sched, reqs, solo, 500, "running the model")


def test_field_that_slipped_past_validation_is_a_400_for_that_request(engine, prompts, solo):
    """A SamplingParams built without validation (as a bug in a front door would), with a
    string temperature: the sampler raises TypeError for that row only."""
    bad = SamplingParams(temperature="hot", max_new_tokens=12)
    sched = make_scheduler(engine)
    reqs = run(engine, sched, prompts, bad_params=bad)
    assert_isolated(engine, sched, reqs, solo, 400, "sampling its next token")


def test_unattributable_batch_failure_fails_its_requests_and_the_scheduler_goes_on(
        engine, prompts, solo):
    sched = make_scheduler(engine)
    broken = {"on": True}
    sched.runner = FaultyRunner(engine.model_runner, lambda fb: broken["on"])
    reqs = [build_req(engine.tokenizer, p, SamplingParams(**GREEDY)) for p in prompts]
    for req in reqs:
        sched.add_request(req)
    sched.step()
    assert all(r.finished_reason["status_code"] == 500 for r in reqs)
    assert all("injected fault" in r.finished_reason["message"] for r in reqs)
    alloc = engine.model_runner.allocator
    assert sched.kv.audit(sched.holders())["owned"] == 0
    assert sched.kv.available_pages() == alloc.total_usable_pages
    broken["on"] = False  # the device recovers: the same scheduler serves the next request
    again = run(engine, sched, prompts[:1], bad_index=-1)
    assert again[0].output_ids == solo[0]
