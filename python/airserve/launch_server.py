"""`python -m airserve.launch_server`: start the HTTP server, with SGLang's flag names.

    python -m airserve.launch_server --model-path PATH --device cpu --port 30000

Without --model-path it serves the default model (SmolLM2-135M-Instruct from PyPI). Unknown
flags are an error (no abbreviations either); common SGLang flags for features airserve does
not have are recognised and refused by name, unless given the value that means "off".
"""

from __future__ import annotations

import argparse
import logging
import sys

from airserve.srt.server_args import ServerArgs

# SGLang flag -> (values that match what airserve does anyway, why else it is refused).
# An empty tuple of values means any use is refused. Flags given a matching value are no-ops.
SGLANG_FLAGS: dict[str, tuple[tuple, str]] = {
    "--pp-size": ((1,), "pipeline parallelism is not supported"),
    "--pipeline-parallel-size": ((1,), "pipeline parallelism is not supported"),
    "--ep-size": ((1,), "expert parallelism is not supported"),
    "--enable-dp-attention": ((), "data-parallel attention is not supported"),
    "--enable-lora": ((), "LoRA adapters are not supported"),
    "--lora-paths": ((), "LoRA adapters are not supported"),
    "--speculative-algorithm": ((), "speculative decoding is not supported"),
    "--chat-template": ((), "the model's own chat template is always used"),
    "--load-format": (("auto",), "weights load from safetensors or GGUF, chosen by the path"),
    "--tokenizer-mode": (("auto",), "only the fast (tokenizers) tokenizer is supported"),
    "--skip-tokenizer-init": ((), "the server always tokenizes"),
    "--is-embedding": ((), "embedding models are not supported"),
    "--revision": ((), "airserve never downloads; pass a local --model-path"),
    "--stream-interval": ((1,), "every decode step is streamed"),
    # Accepted: they ask for what airserve does anyway.
    "--trust-remote-code": ((True,), ""),  # no model code is ever loaded from a checkpoint
    "--disable-overlap-schedule": ((True,), ""),  # the schedule never overlaps
}
_FLAG_TYPES = {"--tp-size": int, "--tensor-parallel-size": int,
               "--pp-size": int, "--pipeline-parallel-size": int,
               "--ep-size": int, "--nnodes": int, "--node-rank": int,
               "--stream-interval": int}
_SWITCHES = ("--enable-dp-attention", "--enable-lora", "--skip-tokenizer-init", "--is-embedding",
             "--trust-remote-code", "--disable-overlap-schedule")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m airserve.launch_server", allow_abbrev=False,
        description="Serve a model over HTTP: SGLang's native API (/generate) and the OpenAI "
                    "API (/v1/completions, /v1/chat/completions).")
    ServerArgs.add_cli_args(parser)
    group = parser.add_argument_group(
        "SGLang flags", "recognised for compatibility; refused unless they ask for what "
                        "airserve does anyway")
    for flag in SGLANG_FLAGS:
        if flag in _SWITCHES:
            group.add_argument(flag, action="store_true", default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS)
        else:
            group.add_argument(flag, type=_FLAG_TYPES.get(flag, str), nargs="+"
                               if flag == "--lora-paths" else None,
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = build_parser()
    ns = parser.parse_args(argv)
    refused = []
    for flag, (accepted, why) in SGLANG_FLAGS.items():
        dest = flag[2:].replace("-", "_")
        if hasattr(ns, dest):
            value = getattr(ns, dest)
            if value not in accepted:
                shown = "" if value is True else f" {value}"
                refused.append(f"{flag}{shown}: {why}")
            delattr(ns, dest)
    if refused:
        parser.error("unsupported SGLang option(s):\n  " + "\n  ".join(refused))
    try:
        return ServerArgs.from_cli_args(ns)
    except ValueError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from airserve.srt.managers.scheduler_process import configure_logging

    configure_logging(args.log_level, "http")
    if args.log_level != "debug":
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if args.node_rank > 0:  # this machine only holds tensor-parallel ranks: no HTTP server
        from airserve.srt.model_executor.tp_worker import run_node_ranks

        return run_node_ranks(args)
    from airserve.srt.entrypoints.http_server import launch_server

    return launch_server(args)


if __name__ == "__main__":
    sys.exit(main())
