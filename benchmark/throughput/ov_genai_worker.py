"""One OpenVINO GenAI run of a W2 job; started by bench_w2.py with the OpenVINO GenAI venv's python.

Reads the job (JSON: model dir, prompts as token ids, output length, threads, scheduler
settings) from argv[1], writes the result (JSON) to argv[2]. Imports nothing of airserve.
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
    t0 = time.perf_counter()
    pipe = genai.ContinuousBatchingPipeline(job["model_dir"], sched, "CPU", props)
    load_s = time.perf_counter() - t0

    def config(max_new: int) -> genai.GenerationConfig:
        cfg = genai.GenerationConfig()
        cfg.max_new_tokens, cfg.ignore_eos, cfg.do_sample = max_new, True, False
        return cfg

    def tensors(prompts: list[list[int]]) -> list:
        return [ov.Tensor(np.asarray([p], dtype=np.int64)) for p in prompts]

    pipe.generate(tensors([job["lone_prompt"]]), [config(8)])  # warm-up: compiles the graphs
    ttft = []
    for _ in range(job["ttft_repeats"]):
        t = time.perf_counter()
        pipe.generate(tensors([job["lone_prompt"]]), [config(1)])
        ttft.append(time.perf_counter() - t)
    prompts = job["prompts"]
    t = time.perf_counter()
    results = pipe.generate(tensors(prompts), [config(job["output_len"])] * len(prompts))
    wall = time.perf_counter() - t
    outputs = [list(r.m_generation_ids[0]) for r in results]
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
