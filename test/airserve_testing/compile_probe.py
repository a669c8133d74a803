"""What a module's compiled graph calls: a recording torch.compile backend."""

from __future__ import annotations

import torch


def compiled_calls(module: torch.nn.Module, *args: torch.Tensor) -> tuple[list, torch.Tensor]:
    """(the call_function targets of the one fullgraph graph dynamo captures, its output)."""
    seen: list = []

    def recording_backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    # Each probe compiles the same code objects (Linear.forward, ...) for another layer: in one
    # test process they pass dynamo's default limit of 8 compiled variants per code object.
    with torch._dynamo.config.patch(recompile_limit=256):
        out = torch.compile(module, backend=recording_backend, fullgraph=True)(*args)
    return seen, out
