"""Data-parallel training on torch.distributed, launched by ``torchrun --nproc-per-node N gtx run ...``.

Every rank builds the same model from the same seed and walks the same shuffled global batches;
rank r takes examples r, r + N, ... of each. The loss is each rank's sum over its scored targets
divided by the global count, times N, so DistributedDataParallel's gradient average is the
gradient of the global batch's mean loss: the same step as one process on the whole batch. Phase
statistics are summed over ranks (tokens/s is the global figure); only rank 0 writes results,
checkpoints and logs. Backend: gloo on CPU, nccl on CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    """This process's place among the training processes: one process is ``World(0, 1)``."""

    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, index: list[int]) -> list[int]:
        return index[self.rank :: self.size]

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks (a no-op for one process)."""
        if self.size > 1:
            values = values.clone()
            dist.all_reduce(values)
        return values

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module to train: DistributedDataParallel over ``model`` when there are several ranks."""
        if self.size == 1:
            return model
        # no buffer to sync (position tables are constant); ACT and the encoder leave some parameters unused in a step
        return torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, find_unused_parameters=True)


def is_main_process() -> bool:
    """Rank 0, or no torchrun at all: the process that prints and writes."""
    return int(os.environ.get("RANK", "0")) == 0


def setup(device: torch.device) -> tuple[World, torch.device]:
    """Join the process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), if any;
    returns the world and this rank's device (CUDA: the local rank's GPU)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(), device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return World(dist.get_rank(), dist.get_world_size()), device
