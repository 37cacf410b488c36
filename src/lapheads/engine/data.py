"""Deterministic, resumable batching for map-style data sets (design notes: docs/design/engine.md, Data order)."""

from __future__ import annotations

import random
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset


def _mix(*xs: int) -> int:
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (int(x) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2))) & 0xFFFFFFFFFFFFFFFF
    return h % (2**63 - 1)


class SeededTransform(Dataset):
    """``base[i] -> transform(item)`` with RNG seeded from (seed, epoch, i)."""

    def __init__(self, base: Any, transform: Optional[Callable[[Any], Any]], seed: int, epoch: int = 0):
        self.base, self.transform, self.seed, self.epoch = base, transform, seed, epoch

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Any:
        item = self.base[i]
        if self.transform is None:
            return item
        s = _mix(self.seed, self.epoch, i)
        state = random.getstate()
        with torch.random.fork_rng(devices=[]):
            # the CPU generator only: transforms run on the CPU, and torch.manual_seed would also
            # (re)seed every accelerator's RNG (outside what fork_rng restores here) and, without
            # CUDA initialised, queue a lazy CUDA seeding that records a stack trace (~3 ms per item)
            torch.default_generator.manual_seed(s)
            random.seed(s)
            out = self.transform(item)
        random.setstate(state)
        return out


def steps_per_epoch(n: int, batch_size: int, world_size: int = 1) -> int:
    return n // (batch_size * world_size)


def epoch_batches(
    dataset: Any,
    batch_size: int,
    seed: int,
    start_micro_step: int = 0,
    *,
    shuffle: bool = True,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    collate_fn: Optional[Callable] = None,
    transform: Optional[Callable] = None,
    epochs: Optional[int] = None,
) -> Iterator[Any]:
    """Endless (or ``epochs``-long) stream of this rank's micro-batches, from ``start_micro_step``.

    Each epoch drops its last incomplete global batch so every rank sees the same number of steps.
    """
    n = len(dataset)
    spe = steps_per_epoch(n, batch_size, world_size)
    if spe == 0:
        raise ValueError(
            f"the data set has {n} items, fewer than one global batch of "
            f"{batch_size * world_size}; lower the batch size"
        )
    epoch, offset = divmod(start_micro_step, spe)
    gb = batch_size * world_size
    while epochs is None or epoch < epochs:
        if shuffle:
            g = torch.Generator().manual_seed(_mix(seed, epoch))
            perm = torch.randperm(n, generator=g)
        else:
            perm = torch.arange(n)
        batches = [
            perm[m * gb + rank * batch_size : m * gb + (rank + 1) * batch_size].tolist() for m in range(offset, spe)
        ]
        ds = SeededTransform(dataset, transform, seed, epoch)
        # An explicit generator: otherwise every new DataLoader iterator draws its worker base
        # seed from the GLOBAL torch RNG, which would shift dropout noise after a resume.
        loader = DataLoader(
            ds,
            batch_sampler=batches,
            num_workers=num_workers,
            collate_fn=collate_fn,
            persistent_workers=False,
            generator=torch.Generator().manual_seed(_mix(seed, epoch, 1)),
        )
        yield from loader
        epoch, offset = epoch + 1, 0
