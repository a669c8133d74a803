"""Few-shot GSM8K accuracy against a running server, with SGLang's prompt and scoring rules.

Usage:
    python -m airserve.test.few_shot_gsm8k --num-questions 200 --port 30000

Rules (SGLang's python/sglang/test/few_shot_gsm8k.py): each example is
"Question: {q}\\nAnswer:" (plus " {answer}" with its `#### N` line for a shot); the prompt is
the first k examples, each followed by "\\n\\n", then the question. Greedy native `/generate`
with stop ["Question", "Assistant:", "<|separator|>"]. The answer is the last run of digits
after removing commas, INVALID when none. Only the GSM8K test split is packaged, so the shots
are its first k rows; by default the scored questions are the rows after them.
`--include-shot-questions` scores rows 0..N-1 instead, which is what SGLang's script does (its
first k questions then appear in the prompt with their solutions).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import re
import sys
import time
from typing import Any

import aiohttp

from airserve.benchmark.backends import (
    ServerUnreachable,
    make_session,
    normalize_base_url,
    probe_server,
)
from airserve.benchmark.datasets import load_gsm8k

INVALID = -9999999
STOP = ["Question", "Assistant:", "<|separator|>"]
_DIGITS = re.compile(r"\d+")


def format_example(row: dict, with_answer: bool) -> str:
    text = "Question: " + row["question"] + "\nAnswer:"
    return text + " " + row["answer"] if with_answer else text


def few_shot_prefix(rows: list[dict], num_shots: int) -> str:
    return "".join(format_example(row, True) + "\n\n" for row in rows[:num_shots])


def get_answer_value(text: str) -> int:
    """Last run of digits after removing commas (sign and decimals dropped), else INVALID.

    Parsed as a Python literal like SGLang, so a zero-padded number ("007") is INVALID too.
    """
    numbers = _DIGITS.findall(text.replace(",", ""))
    if not numbers:
        return INVALID
    try:
        value = ast.literal_eval(numbers[-1])
    except (SyntaxError, ValueError):
        return INVALID
    return value if isinstance(value, int) else INVALID


def build_questions(
    rows: list[dict], num_shots: int, num_questions: int, include_shot_questions: bool = False
) -> list[tuple[int, str, int]]:
    """(row index, full prompt, gold answer) for each scored question."""
    prefix = few_shot_prefix(rows, num_shots)
    first = 0 if include_shot_questions else num_shots
    out = []
    for i in range(first, min(first + num_questions, len(rows))):
        label = get_answer_value(rows[i]["answer"])
        if label == INVALID:
            raise ValueError(f"row {i} has no numeric answer: {rows[i]['answer'][-80:]!r}")
        out.append((i, prefix + format_example(rows[i], False), label))
    return out


async def _generate(
    session: aiohttp.ClientSession, url: str, prompt: str, args: argparse.Namespace
) -> dict[str, Any]:
    payload = {
        "text": prompt,
        "sampling_params": {
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "stop": STOP,
        },
    }
    try:
        async with session.post(url, json=payload) as resp:
            body = await resp.text()
            if resp.status != 200:
                return {"error": f"HTTP {resp.status} from {url}: {body[:500]}"}
            data = json.loads(body)
        return {
            "output": data["text"],
            "completion_tokens": int(data["meta_info"]["completion_tokens"]),
        }
    except TimeoutError:
        return {"error": f"timed out waiting for {url} (see --request-timeout)"}
    except (aiohttp.ClientError, ValueError, KeyError, TypeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


async def _run_all(
    base_url: str, prompts: list[str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    semaphore = asyncio.Semaphore(max(args.parallel, 1))
    pbar = None
    if not args.disable_tqdm:
        from tqdm import tqdm

        pbar = tqdm(total=len(prompts))

    async def one(session: aiohttp.ClientSession, prompt: str) -> dict[str, Any]:
        async with semaphore:
            result = await _generate(session, base_url + "/generate", prompt, args)
        if pbar is not None:
            pbar.update(1)
        return result

    async with make_session(10.0, args.request_timeout) as session:
        results = await asyncio.gather(*(one(session, p) for p in prompts))
    if pbar is not None:
        pbar.close()
    return list(results)


async def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the evaluation, prints SGLang's four result lines and returns the metrics."""
    base_url = normalize_base_url(args.host, args.port)
    await probe_server(base_url)
    rows = load_gsm8k(args.data_path)
    questions = build_questions(
        rows, args.num_shots, args.num_questions, args.include_shot_questions
    )

    tic = time.perf_counter()
    results = await _run_all(base_url, [prompt for _, prompt, _ in questions], args)
    latency = time.perf_counter() - tic

    records = []
    for (index, _, label), res in zip(questions, results, strict=True):
        pred = get_answer_value(res.get("output", ""))
        records.append(
            {
                "index": index,
                "output": res.get("output", ""),
                "pred": None if pred == INVALID else pred,
                "label": label,
                "correct": pred == label,
                "completion_tokens": res.get("completion_tokens", 0),
                "error": res.get("error", ""),
            }
        )
    n = max(len(records), 1)
    accuracy = sum(r["correct"] for r in records) / n
    invalid = sum(r["pred"] is None for r in records) / n
    num_output_tokens = sum(r["completion_tokens"] for r in records)
    output_throughput = num_output_tokens / latency if latency > 0 else 0.0
    failed = [r for r in records if r["error"]]

    print(f"Accuracy: {accuracy:.3f}")
    print(f"Invalid: {invalid:.3f}")
    print(f"Latency: {latency:.3f} s")
    print(f"Output throughput: {output_throughput:.3f} token/s")
    if failed:
        print(f"Failed requests: {len(failed)}. First error: {failed[0]['error']}")

    metrics = {
        "accuracy": accuracy,
        "invalid": invalid,
        "latency": latency,
        "output_throughput": output_throughput,
        "num_output_tokens": num_output_tokens,
        "num_questions": len(records),
        "failed": len(failed),
    }
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump({"config": vars(args), **metrics, "questions": records}, f, indent=1)
    return metrics


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Few-shot GSM8K accuracy (SGLang's rules).")
    p.add_argument("--num-shots", type=int, default=5)
    p.add_argument("--data-path", default=None, help="GSM8K jsonl; default: packaged test split")
    p.add_argument("--num-questions", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--parallel", type=int, default=64)
    p.add_argument("--host", default="http://127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--result-file",
        default=None,
        help="write per-question outputs and answers as JSON (for diffing runs)",
    )
    p.add_argument(
        "--include-shot-questions",
        action="store_true",
        help="score rows from 0 like SGLang's script (shots included)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds without a byte from the server before a request fails",
    )
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Returns 0 when every request got an answer, 1 otherwise."""
    args = build_parser().parse_args(argv)
    try:
        metrics = asyncio.run(run_eval(args))
    except (ServerUnreachable, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 1 if metrics["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
