"""The tensor-parallel group a model's layers talk through.

`TPGroup` is what a layer needs to know about tensor parallelism: its rank, the group size and
the process group to reduce over. Collectives are torch's functional collectives, which run
eagerly and also trace into compiled graphs (torch.compile lowers them to the group's backend:
gloo on CPU, NCCL on CUDA, HCCL on Ascend).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

# device -> torch.distributed backend
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed ProcessGroup (None: the default group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks (x itself at size 1)."""
        if self.size == 1:
            return x
        from torch.distributed import _functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_reduce(x, "sum", self._group()))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x concatenated along the last dim, in rank order."""
        if self.size == 1:
            return x
        from torch.distributed import _functional_collectives as funcol

        out = funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), 0, self._group()))
        # [size * rows, cols] -> [rows, size * cols]
        return torch.cat(out.chunk(self.size, dim=0), dim=-1)

    def _group(self) -> Any:
        import torch.distributed as dist

        return self.group if self.group is not None else dist.group.WORLD


SINGLE = TPGroup()


def select_device(device: str, index: int) -> None:
    """Make cuda/npu device `index` this process's current device (what "cuda"/"npu" tensors
    land on); refused when the machine has no such device. Nothing on cpu."""
    if device == "cpu":
        return
    if device == "npu":
        from airserve.srt.hardware import import_torch_npu

        import_torch_npu()
    backend = torch.npu if device == "npu" else torch.cuda
    count = backend.device_count()
    if index >= count:
        raise ValueError(f"this process needs {device} device {index} (--base-gpu-id + "
                         f"dp rank x tp size + tp rank) but the machine shows {count}; lower "
                         "--base-gpu-id, --dp-size or --tp-size")
    backend.set_device(index)


def init_tp_group(device: str, rank: int, size: int, init_method: str,
                  timeout_s: float) -> TPGroup:
    """Join the `size`-rank group as `rank` (`init_method` a tcp:// address every rank can
    reach); collectives that wait longer than `timeout_s` raise instead of hanging."""
    import torch.distributed as dist

    if size == 1:
        return SINGLE
    backend = BACKENDS.get(device)
    if backend is None:
        raise ValueError(f"--tp-size {size} on device {device!r}: no torch.distributed backend "
                         f"(known: {', '.join(f'{d}: {b}' for d, b in BACKENDS.items())})")
    if backend == "hccl":
        import torch_npu  # noqa: F401 - registers the hccl backend and torch.npu
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    logger.info("tensor parallel rank %d of %d joined over %s (%s)", rank, size, backend,
                init_method)
    return TPGroup(rank, size, dist.group.WORLD)
