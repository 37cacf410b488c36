"""Process-group helpers for torchrun and SLURM (DDP / FSDP2): gloo on CPU, nccl on GPU.
Design notes: docs/design/engine.md (Multi-GPU)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_groups_created = 0  # process groups this process initialised (each after the first gets its own keys)


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
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(requested)
    return torch.device("cuda", local_rank) if dev.type == "cuda" and dev.index is None else dev


def env_from_slurm(job: Any = None, apply: bool = False) -> dict[str, str]:
    """torchrun's variables for this SLURM task from submitit's ``job`` (empty for one task or under torchrun).

    ``MASTER_PORT`` is ``LAPHEADS_MASTER_PORT`` or 20000 + job id mod 20000; ``apply`` also sets them."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun (or a caller) has set them
        return {}
    if job is None:
        import submitit  # the slurm extra; only called inside a submitit job

        job = submitit.JobEnvironment()
    if job.num_tasks <= 1:
        return {}
    raw_id = str(os.environ.get("SLURM_JOB_ID") or job.raw_job_id).split("_")[0]
    port = os.environ.get("LAPHEADS_MASTER_PORT") or str(20000 + int(raw_id) % 20000 if raw_id.isdigit() else 29500)
    env = {
        "RANK": str(job.global_rank),
        "WORLD_SIZE": str(job.num_tasks),
        "LOCAL_RANK": str(job.local_rank),
        "LOCAL_WORLD_SIZE": str(job.num_tasks // max(1, job.num_nodes)),
        "NODE_RANK": str(job.node),
        "MASTER_ADDR": str(job.hostnames[0]),
        "MASTER_PORT": port,
    }
    if apply:
        os.environ.update(env)
    return env


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
        fresh: dict[str, Any] = {}
        if _groups_created:  # a fresh key space in the same store (pytorch#55967)
            store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
            fresh = dict(
                rank=rank, world_size=world, store=dist.PrefixStore(f"lapheads_group_{_groups_created}", store)
            )
        dist.init_process_group(backend=backend, timeout=timeout, **fresh)
        _groups_created += 1
    return DistInfo(rank=rank, world_size=world, local_rank=local, device=dev)


def agree(info: DistInfo, outcome: Any) -> Any:
    """Rank 0's ``outcome`` (a value, or an exception to raise) on every rank."""
    if info.distributed:
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def initialized() -> bool:
    """Whether this process is in a process group."""
    return dist.is_available() and dist.is_initialized()


def all_max(value: int, device: torch.device) -> int:
    """The largest ``value`` over the ranks (one all-reduce; ``value`` itself without a process group)."""
    if not initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def barrier() -> None:
    if initialized():
        dist.barrier()


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if initialized() and dist.get_world_size() > 1:
        t = t.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def cleanup() -> None:
    if initialized():
        dist.destroy_process_group()
