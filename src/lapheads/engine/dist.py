"""Process-group helpers for torchrun (DDP / FSDP2): gloo on CPU, nccl on GPU.

``lapheads train ...`` works unchanged as a single process or under
``torchrun --nproc_per_node=N -m lapheads.cli train ...``: the process group is created from the
environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK). A rank that loses its peers does not
hang forever: collectives time out after ``LAPHEADS_DIST_TIMEOUT`` seconds (default 120) and the
error names the rank.

A process may create the group more than once (``lapheads train retrofit`` runs its baseline as a
second ``launch``, which ends the group like the first). torch restarts its group names after
``destroy_process_group``, so under torchrun, whose store outlives the group, a second group would
read the first one's rendezvous keys and hang (pytorch#55967); every group after the first gets
keys of its own (a ``PrefixStore``).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

_groups_created = 0  # process groups this process initialised (see the module docstring)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        return torch.device("cpu")
    dev = torch.device(requested)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank)
    return dev


def init_distributed(device: str = "auto") -> DistInfo:
    """Initialise the process group when launched by torchrun; otherwise a single process."""
    global _groups_created
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        timeout = datetime.timedelta(seconds=float(os.environ.get("LAPHEADS_DIST_TIMEOUT", "120")))
        if _groups_created:  # a fresh key space in the same store (pytorch#55967)
            store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
            dist.init_process_group(backend=backend, timeout=timeout, rank=rank, world_size=world,
                                    store=dist.PrefixStore(f"lapheads_group_{_groups_created}", store))
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
        _groups_created += 1
    return DistInfo(rank=rank, world_size=world, local_rank=local, device=dev)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = t.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
