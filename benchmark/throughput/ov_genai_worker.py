"""One OpenVINO GenAI run of a W2 (or W1) job; started by bench_w2.py / bench_w1.py with the
OpenVINO GenAI venv's python.

Reads the job (JSON: model dir, prompts as token ids, output length, threads, scheduler
settings) from argv[1], writes the result (JSON) to argv[2]. Imports nothing of airserve.
`"pipeline": "llm"` runs `LLMPipeline` (OpenVINO GenAI's stateful pipeline for one stream, its
fastest for W1) instead of `ContinuousBatchingPipeline`; it takes one prompt.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time


def main() -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    with open(sys.argv[1]) as f:
        job = json.load(f)
    sched = genai.SchedulerConfig()
    sched.max_num_batched_tokens = job["max_num_batched_tokens"]
    sched.cache_size = job["kv_cache_gb"]
    sched.enable_prefix_caching = False
    props = {"INFERENCE_NUM_THREADS": job["threads"]}
    if job.get("precision"):
        props["INFERENCE_PRECISION_HINT"] = job["precision"]
    llm = job.get("pipeline") == "llm"
    if llm and len(job["prompts"]) != 1:
        raise SystemExit("pipeline llm (LLMPipeline) runs one prompt; use the continuous "
                         "batching pipeline for more")
    t0 = time.perf_counter()
    if llm:
        pipe = genai.LLMPipeline(job["model_dir"], "CPU", **props)
    else:
        pipe = genai.ContinuousBatchingPipeline(job["model_dir"], sched, "CPU", props)
    load_s = time.perf_counter() - t0

    def config(max_new: int) -> genai.GenerationConfig:
        cfg = genai.GenerationConfig()
        cfg.max_new_tokens, cfg.ignore_eos, cfg.do_sample = max_new, True, False
        return cfg

    def tensors(prompts: list[list[int]]) -> list:
        return [ov.Tensor(np.asarray([p], dtype=np.int64)) for p in prompts]

    def generate(prompts: list[list[int]], max_new: int) -> list[list[int]]:
        if llm:
            r = pipe.generate(tensors(prompts)[0], config(max_new))
            return [list(r.tokens[0])]
        results = pipe.generate(tensors(prompts), [config(max_new)] * len(prompts))
        return [list(r.m_generation_ids[0]) for r in results]

    generate([job["lone_prompt"]], 8)  # warm-up: compiles the graphs
    ttft = []
    for _ in range(job["ttft_repeats"]):
        t = time.perf_counter()
        generate([job["lone_prompt"]], 1)
        ttft.append(time.perf_counter() - t)
    t = time.perf_counter()
    outputs = generate(job["prompts"], job["output_len"])
    wall = time.perf_counter() - t
    out = {
        "load_s": load_s,
        "wall_s": wall,
        "output_tokens": sum(len(o) for o in outputs),
        "ttft_lone_ms": 1000 * statistics.median(ttft),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "output_ids": outputs,
        "versions": {"openvino_genai": genai.__version__, "openvino": ov.__version__},
    }
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
