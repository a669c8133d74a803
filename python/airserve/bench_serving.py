"""Benchmark online serving, SGLang-compatible (flags, table and JSONL fields).

Usage:
    python -m airserve.bench_serving --backend airserve --dataset-name random \
        --num-prompts 200 --random-input-len 256 --random-output-len 128 --output-file out.jsonl

Offline: datasets come from the installed data packages or --dataset-path, the tokenizer
from --tokenizer or the server's `GET /get_model_info`. Never hangs on a dead server: it
probes `/v1/models` (or `/health`) first and every request has connect and read timeouts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import resource
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import aiohttp
import numpy as np

from airserve.benchmark.backends import (
    BACKENDS,
    RequestInput,
    RequestOutput,
    ServerUnreachable,
    api_path,
    first_error,
    get_json,
    make_session,
    normalize_base_url,
    probe_server,
    send_request,
)
from airserve.benchmark.datasets import (
    DatasetRow,
    load_sharegpt_records,
    load_text_corpus,
    load_tokenizer,
    sample_generated_shared_prefix_requests,
    sample_random_requests,
    sample_sharegpt_requests,
    sharegpt_pairs,
)
from airserve.benchmark.metrics import calculate_metrics, format_table

T = TypeVar("T")

CONNECT_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 5.0


class BenchmarkError(RuntimeError):
    """A setup failure the user must fix; printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Benchmark the online serving throughput.")
    p.add_argument("--backend", choices=BACKENDS, default="airserve")
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:30000")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None, help="default: first id of GET /v1/models")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json, model dir or GGUF; default: the server's tokenizer_path",
    )
    p.add_argument(
        "--dataset-name",
        choices=("sharegpt", "random", "random-ids", "generated-shared-prefix"),
        default="sharegpt",
    )
    p.add_argument(
        "--dataset-path",
        default=None,
        help="ShareGPT json (sharegpt, random) or GSM8K jsonl (random text source)",
    )
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--sharegpt-context-len", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    # generated-shared-prefix (SGLang's names and defaults); --num-prompts does not apply.
    p.add_argument("--gsp-num-groups", type=int, default=64, help="system prompts")
    p.add_argument("--gsp-prompts-per-group", type=int, default=16,
                   help="questions sharing each system prompt")
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048, help="tokens")
    p.add_argument("--gsp-question-len", type=int, default=128, help="tokens")
    p.add_argument("--gsp-output-len", type=int, default=256, help="tokens")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s with Poisson arrivals; inf sends all at once",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before the run")
    p.add_argument("--output-file", default=None, help="append one JSON line per run")
    p.add_argument(
        "--output-details",
        action="store_true",
        help="also write per-request lens, TTFTs, ITLs, texts and errors",
    )
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds without a byte from the server before a request fails",
    )
    return p


def resolve_base_url(args: argparse.Namespace) -> str:
    if args.base_url:
        return normalize_base_url(args.base_url)
    return normalize_base_url(args.host, args.port)


async def resolve_tokenizer(args: argparse.Namespace, base_url: str) -> Any:
    path = args.tokenizer
    if path is None:
        info = await get_json(base_url, "/get_model_info", PROBE_TIMEOUT_S) or {}
        path = info.get("tokenizer_path") or info.get("model_path")
        if not path:
            raise BenchmarkError(
                f"{base_url}/get_model_info gave no tokenizer_path/model_path; pass --tokenizer"
            )
    try:
        return load_tokenizer(path)
    except Exception as e:
        raise BenchmarkError(f"cannot load tokenizer {path!r}: {e}") from e


def build_dataset(
    args: argparse.Namespace, tokenizer: Any, rng: np.random.Generator
) -> list[DatasetRow]:
    if args.dataset_name == "sharegpt":
        pairs = sharegpt_pairs(load_sharegpt_records(args.dataset_path))
        rows = sample_sharegpt_requests(
            pairs,
            args.num_prompts,
            tokenizer,
            rng,
            fixed_output_len=args.sharegpt_output_len,
            context_len=args.sharegpt_context_len,
        )
    elif args.dataset_name == "generated-shared-prefix":
        try:
            rows = sample_generated_shared_prefix_requests(
                args.gsp_num_groups,
                args.gsp_prompts_per_group,
                args.gsp_system_prompt_len,
                args.gsp_question_len,
                args.gsp_output_len,
                tokenizer,
                rng,
                load_text_corpus(args.dataset_path),
            )
        except ValueError as e:
            raise BenchmarkError(str(e)) from None
    else:
        texts = load_text_corpus(args.dataset_path) if args.dataset_name == "random" else None
        rows = sample_random_requests(
            args.random_input_len,
            args.random_output_len,
            args.num_prompts,
            args.random_range_ratio,
            tokenizer,
            rng,
            texts=texts,
        )
    if not rows:
        raise BenchmarkError(f"the {args.dataset_name} dataset produced no requests")
    if len(rows) < args.num_prompts:
        print(f"Warning: only {len(rows)} of {args.num_prompts} prompts passed the filters")
    print(f"#Input tokens: {sum(r.prompt_len for r in rows)}")
    print(f"#Output tokens: {sum(r.output_len for r in rows)}")
    return rows


async def arrivals(
    items: Sequence[T], request_rate: float, rng: np.random.Generator
) -> AsyncIterator[T]:
    """Yields items with exponential gaps (a Poisson process); all at once for rate inf."""
    for item in items:
        yield item
        if math.isfinite(request_rate):
            await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))


async def run_requests(
    args: argparse.Namespace, session: Any, inputs: list[RequestInput], rng: np.random.Generator
) -> tuple[list[RequestOutput], float]:
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    pbar = None
    if not args.disable_tqdm:
        from tqdm import tqdm

        pbar = tqdm(total=len(inputs))

    async def one(inp: RequestInput) -> RequestOutput:
        if semaphore is None:
            out = await send_request(args.backend, session, inp)
        else:
            async with semaphore:
                out = await send_request(args.backend, session, inp)
        if pbar is not None:
            pbar.update(1)
        return out

    start = time.perf_counter()
    tasks = []
    async for inp in arrivals(inputs, args.request_rate, rng):
        tasks.append(asyncio.create_task(one(inp)))
    outputs = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()
    return outputs, duration


async def warmup(args: argparse.Namespace, session: Any, first: RequestInput) -> None:
    if args.warmup_requests <= 0:
        return
    print(f"Starting warmup with {args.warmup_requests} sequences...")
    short = RequestInput(**{**first.__dict__, "output_len": min(first.output_len, 32)})
    outs = await asyncio.gather(
        *(send_request(args.backend, session, short) for _ in range(args.warmup_requests))
    )
    if not any(o.success for o in outs):
        raise BenchmarkError(f"warmup failed: {first_error(outs)}")
    print(f"Warmup completed with {args.warmup_requests} sequences. Starting main benchmark run...")


async def flush_cache(session: Any, base_url: str) -> None:
    try:
        async with session.post(base_url + "/flush_cache") as resp:
            print(f"POST /flush_cache: HTTP {resp.status}")
    except (aiohttp.ClientError, TimeoutError) as e:
        raise BenchmarkError(f"POST {base_url}/flush_cache failed: {e}") from e


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf": keeps the line valid JSON
    return value


async def benchmark(args: argparse.Namespace, tokenizer: Any = None) -> dict[str, Any]:
    """Runs one benchmark and returns the result dict (also appended to --output-file).

    `tokenizer` (anything with encode/decode) skips --tokenizer and the server lookup.
    """
    base_url = resolve_base_url(args)
    model_ids = await probe_server(base_url, PROBE_TIMEOUT_S)
    model = args.model or (model_ids[0] if model_ids else "default")
    if tokenizer is None:
        tokenizer = await resolve_tokenizer(args, base_url)
    rng = np.random.default_rng(args.seed)
    rows = build_dataset(args, tokenizer, rng)
    api_url = base_url + api_path(args.backend)
    inputs = [
        RequestInput(
            r.prompt,
            api_url,
            r.prompt_len,
            r.output_len,
            model,
            ignore_eos=not args.disable_ignore_eos,
        )
        for r in rows
    ]
    async with make_session(CONNECT_TIMEOUT_S, args.request_timeout) as session:
        await warmup(args, session, inputs[0])
        if args.flush_cache:
            await flush_cache(session, base_url)
        outputs, duration = await run_requests(args, session, inputs, rng)

    metrics = calculate_metrics(outputs, duration, tokenizer)
    error = first_error(outputs)
    if metrics.failed:
        print(f"\nFailed requests: {metrics.failed}. First error: {error}")
    print("\n" + format_table(metrics, args.backend, args.request_rate, args.max_concurrency))

    config = {k: _jsonable(v) for k, v in vars(args).items()}
    result = {
        **config,
        "model": model,
        "base_url": base_url,
        **metrics.to_dict(),
        "first_error": error,
    }
    if args.output_details:
        result |= {
            "input_lens": [o.prompt_len for o in outputs],
            "output_lens": [o.output_len if o.success else 0 for o in outputs],
            "ttfts": [o.ttft for o in outputs],
            "itls": [o.itl for o in outputs],
            "generated_texts": [o.generated_text for o in outputs],
            "errors": [o.error for o in outputs],
        }
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
    return result


def _raise_open_file_limit(target: int = 65535) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(target, hard), hard))
        except (ValueError, OSError):
            pass


def main(argv: list[str] | None = None, tokenizer: Any = None) -> int:
    """CLI entry; returns 0 when at least one request succeeded, 1 otherwise."""
    args = build_parser().parse_args(argv)
    print(f"benchmark_args={args}")
    _raise_open_file_limit()
    try:
        result = asyncio.run(benchmark(args, tokenizer))
    except (ServerUnreachable, BenchmarkError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if result["completed"] == 0:
        print("error: all requests failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
