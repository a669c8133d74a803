"""lm-eval's `local-completions` model against a real airserve server on the tiny float32
model: one loglikelihood and one generate_until task on the packaged GSM8K rows
(benchmark/lm_eval/tasks), no hub access. The loglikelihoods must equal those of lm-eval's own
`hf` model on the same weights within 1e-4 (absolute, per continuation: a sum over its
tokens of float32 logprobs from two different implementations).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from airserve_testing.server_utils import ServerProcess

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra")

TASKS = str(Path(__file__).resolve().parents[2] / "benchmark" / "lm_eval" / "tasks")
LIMIT = 3
ATOL = 1e-4  # measured: 1.05e-05 on three GSM8K answers
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # float32 whatever the CPU, as lm-eval's hf model (dtype=float32): `auto` takes bfloat16
    # above the packed limit on CPUs with avx512_bf16 or AMX, far outside ATOL.
    srv = ServerProcess(tiny_llama_dir, "--max-total-tokens", "4096", "--dtype", "float32",
                        api_key=None).wait_ready()
    yield srv
    srv.stop()


def evaluate(model: str, model_args: str, tasks: list[str]) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, limit=LIMIT,
                           task_manager=TaskManager(include_path=TASKS), log_samples=True,
                           batch_size=1)


def loglikelihoods(result: dict, task: str) -> list[float]:
    return [s["resps"][0][0][0] for s in sorted(result["samples"][task],
                                                key=lambda s: s["doc_id"])]


@pytest.mark.slow  # a server, two lm-eval runs and transformers: ~50 s of CPU, longer when busy
def test_local_completions_matches_lm_eval_hf(server, tiny_llama_dir, monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    ours = evaluate("local-completions", f"model=default,base_url={server.url}/v1/completions,"
                    f"tokenizer_backend=huggingface,tokenizer={tiny_llama_dir},"
                    "tokenized_requests=True,max_length=480,num_concurrent=1,max_retries=1",
                    ["airserve_gsm8k_loglikelihood", "airserve_gsm8k_generate"])
    ref = evaluate("hf", f"pretrained={tiny_llama_dir},dtype=float32,device=cpu,max_length=480",
                   ["airserve_gsm8k_loglikelihood"])
    got = loglikelihoods(ours, "airserve_gsm8k_loglikelihood")
    want = loglikelihoods(ref, "airserve_gsm8k_loglikelihood")
    assert len(got) == LIMIT and all(x < 0 for x in got)
    diff = max(abs(a - b) for a, b in zip(got, want))
    print(f"loglikelihoods: airserve {got}, lm-eval hf {want}, max |diff| {diff:.2e}")
    assert diff < ATOL, (got, want)
    generated = ours["samples"]["airserve_gsm8k_generate"]
    assert len(generated) == LIMIT and all(isinstance(s["resps"][0][0], str) for s in generated)
    assert "exact_match,last_number" in ours["results"]["airserve_gsm8k_generate"]
