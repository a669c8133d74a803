"""Which decode graph runner a configuration gets (DESIGN.md device table)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from airserve.srt.server_args import ServerArgs

if TYPE_CHECKING:
    from airserve.srt.model_executor.model_runner import ModelRunner


def check_device(args: ServerArgs) -> None:
    """Raise a clear error if the requested device is absent; never switch devices silently."""
    if args.device != "cpu":
        raise RuntimeError(f"--device {args.device} is not available in this build yet")


def create_graph_runner(model_runner: ModelRunner):
    args = model_runner.server_args
    if args.device == "cpu" and not args.enable_torch_compile:
        return None
    raise NotImplementedError("graph runners are not built yet")
