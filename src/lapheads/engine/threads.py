"""How many CPU threads torch uses in a lapheads process (design notes: docs/design/engine.md, Threads)."""

from __future__ import annotations

import math
import os
import time
from typing import Optional

import torch

from ..errors import ConfigError

__all__ = ["available_cpus", "busy_fraction", "choose_threads", "configure_threads"]


def available_cpus() -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup v2 CPU quota; >= 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            n = min(n, math.ceil(float(quota) / float(period)))
    except (OSError, ValueError):
        pass
    return max(1, n)


def _cpu_times() -> Optional[tuple[float, float]]:
    """(busy, total) jiffies summed over all cores, from the first line of /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    # guest time is already counted in user time; leave it out of the total
    total = sum(fields[:8])
    return total - idle, total


def busy_fraction(window_s: float = 0.15) -> float:
    """Fraction in [0, 1] of the machine's CPU time that other processes use over ``window_s`` (this
    process sleeps); the 1-minute load average where ``/proc/stat`` is unavailable."""
    a = _cpu_times()
    if a is not None:
        time.sleep(window_s)
        b = _cpu_times()
        if b is not None and b[1] > a[1]:
            return min(1.0, max(0.0, (b[0] - a[0]) / (b[1] - a[1])))
    try:
        return min(1.0, float(os.getloadavg()[0]) / (os.cpu_count() or 1))
    except (AttributeError, OSError):
        return 0.0


def choose_threads(requested: int = 0, *, local_world_size: Optional[int] = None) -> tuple[int, str]:
    """``(threads, reason)``: the intra-op thread count for this process and a short phrase why.

    ``requested`` is ``train.threads`` (0: automatic); ``local_world_size`` defaults to ``LOCAL_WORLD_SIZE``."""
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise ConfigError(f"train.threads={requested!r} must be an integer >= 0 (0 = automatic)")
    if requested > 0:
        return requested, "train.threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ConfigError(f"OMP_NUM_THREADS={env!r} must be a positive integer") from None
        if n < 1:
            raise ConfigError(f"OMP_NUM_THREADS={env!r} must be a positive integer")
        return n, "OMP_NUM_THREADS"
    procs = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    cpus = available_cpus()
    share = max(1, cpus // max(1, procs))
    free = max(0.0, cpus - cpus * busy_fraction())
    # round half up: a core that is half busy still gives a thread most of a core
    threads = max(1, min(share, math.floor(free / max(1, procs) + 0.5)))
    return threads, f"auto: {cpus} cores, {cpus - free:.1f} busy, {procs} process(es)"


def configure_threads(requested: int = 0) -> tuple[int, str]:
    """Choose (see :func:`choose_threads`) and apply the thread count; returns it and the reason."""
    threads, reason = choose_threads(requested)
    torch.set_num_threads(threads)
    return threads, reason
