"""One start of a compiled CPU runner in this process, for start-up tests that need a fresh
process: prints a JSON line with the runner's report and greedy tokens from the compiled
runner and from an eager runner sharing its model.

    python -m airserve_testing.compiled_start MODEL_DIR CACHE_DIR BUCKETS [STEPS]

BUCKETS: comma-separated batch sizes (e.g. 2,3). CACHE_DIR "none": no --compile-cache-dir (the
graphs compile through dynamo's inductor backend and are not stored).
"""

from __future__ import annotations

import json
import sys

import torch

from airserve_testing.decode_driver import Requests, make_runner, random_prompts


def greedy(runner, prompt: list[int], steps: int) -> list[int]:
    reqs = Requests(runner, [prompt])
    token = int(reqs.prefill_logits[-1].argmax())
    tokens = [token]
    for _ in range(steps - 1):
        token = int(reqs.decode([token])[0].argmax())
        tokens.append(token)
    reqs.release()
    return tokens


class CompileWorkers:
    """The most of inductor's compile-pool processes (its `compile_worker` sidecar and workers)
    alive at once among this process's children, sampled every 50 ms in a thread."""

    def __init__(self) -> None:
        import threading

        import psutil

        self.most, self._done = 0, threading.Event()
        self._me = psutil.Process()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._done.wait(0.05):
            found = 0
            for child in self._me.children(recursive=True):
                try:
                    found += any("compile_worker" in part for part in child.cmdline())
                except psutil.Error:  # gone meanwhile
                    pass
            self.most = max(self.most, found)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.most


def count_compiler_runs(set_attr=setattr) -> list[str]:
    """Record every compiler command inductor runs in this process from now on (the list fills
    as they run); `set_attr` installs the recorder (a test passes monkeypatch.setattr, which
    undoes it)."""
    import torch._inductor.cpp_builder as cpp_builder

    commands: list[str] = []
    run = cpp_builder._run_compile_cmd

    def recording(cmd_line, *args, **kwargs):
        commands.append(cmd_line)
        return run(cmd_line, *args, **kwargs)

    set_attr(cpp_builder, "_run_compile_cmd", recording)
    return commands


def main() -> None:
    workers = CompileWorkers()
    compiler_runs = count_compiler_runs()
    model_dir, cache_dir = sys.argv[1], sys.argv[2]
    buckets = tuple(int(b) for b in sys.argv[3].split(","))
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    torch.manual_seed(0)
    graph = make_runner(model_dir, enable_torch_compile=True, cuda_graph_bs=buckets,
                        compile_cache_dir=None if cache_dir == "none" else cache_dir)
    eager = make_runner(model_dir, runner_from=graph)
    prompt = random_prompts(graph.model_config.vocab_size, [9])[0]
    replays = graph.graph_runner.replay_count
    store = graph.graph_runner.store
    out = {"report": graph.graph_runner.report(), "store_dir": store and store.dir,
           "graph": greedy(graph, prompt, steps), "eager": greedy(eager, prompt, steps)}
    out["replays"] = graph.graph_runner.replay_count - replays
    out["compile_workers"] = workers.stop()
    out["compiler_runs"] = [c.split(" -")[0] for c in compiler_runs]
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
