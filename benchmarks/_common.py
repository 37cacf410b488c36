"""Shared helpers for the benchmarks in this folder.

Design choices:

* Time: every variant is warmed up first, then the variants are measured INTERLEAVED, round by
  round, each round in a new shuffled order (seeded), and each variant's median over the rounds is
  reported. On a shared machine the load drifts; interleaving exposes every variant to the same
  drift, so the RATIOS measured in one run are trustworthy even when absolute times wobble. The
  order is shuffled, not rotated: with a rotation each variant always follows the same other one,
  and a variant measured right after one that frees a large heap (the materialised T x T
  operator) paid for it in every round (the learnable variant, 13% at T=4096).
* Peak memory on CPU: each (variant, size) runs in a FRESH Python subprocess that builds its
  inputs and warms its kernels up on a tiny problem (lazy library loading and thread pools must
  not count). Then the kernel's high-water mark of the resident set is reset (Linux: write ``5`` to
  ``/proc/self/clear_refs``), the current resident set is read, the full problem runs once
  (forward + backward) and the growth ``VmHWM - VmRSS_before`` is reported. This is what the
  operating system actually had to provide, it sees every allocation (torch's CPU allocator is
  plain malloc; torch has no CPU twin of ``torch.cuda.max_memory_allocated``), and the reset
  matters: ``import torch`` alone peaks far above a small step, which would hide it. Resolution is
  a page; scratch buffers of the thread pool are included, so benchmarks judge GROWTH between
  sizes rather than one absolute figure. Without ``clear_refs`` (macOS, old kernels) it falls back
  to ``ru_maxrss`` growth, which only sees peaks above the import peak.
  (The torch profiler's ``profile_memory=True`` lists allocation events, not a peak, and
  tracemalloc does not see torch's C++ allocations.)
"""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable, Sequence

__all__ = [
    "time_interleaved",
    "medians",
    "paired_ratio",
    "maxrss_bytes",
    "PeakMemory",
    "run_child",
    "machine_line",
    "markdown_table",
]


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    *,
    warmup: int = 2,
    repeats: int = 7,
    min_time: float = 0.0,
    cpu: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Wall time (seconds) of each callable in every round, measured interleaved.

    Args:
        fns: name -> zero-argument callable doing one complete measured step.
        warmup: untimed calls per callable before measuring.
        repeats: measured rounds; every round calls each callable once, in a shuffled order.
        min_time: if > 0, each measurement loops a callable until this many seconds have passed
            and divides by the number of calls (for steps much shorter than the timer's noise).
        cpu: if given, filled like the result with the CPU time of this process per call
            (``time.process_time``, every thread). On a shared VM, wall time also counts the
            moments the core was taken away; CPU time is the work the step itself did.

    Returns:
        name -> list of per-round times (round r at index r), for :func:`medians` and
        :func:`paired_ratio`.
    """
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = random.Random(r).sample(names, len(names))
        for name in order:
            fn, calls = fns[name], 0
            start, cpu_start = time.perf_counter(), time.process_time()
            while True:
                fn()
                calls += 1
                elapsed = time.perf_counter() - start
                if elapsed >= min_time:
                    break
            times[name].append(elapsed / calls)
            if cpu is not None:
                cpu.setdefault(name, []).append((time.process_time() - cpu_start) / calls)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    """Median over rounds of each variant's time."""
    return {n: statistics.median(t) for n, t in times.items()}


def paired_ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of ``num / den`` measured in the SAME round (adjacent in time), which
    cancels load drift better than the ratio of two medians."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def maxrss_bytes() -> int:
    """High-water resident set size of this process, in bytes (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Growth of this process's peak resident set over a block of code, in bytes.

    Usage: ``pm = PeakMemory(); pm.start(); work(); growth = pm.stop()``.
    """

    def start(self) -> None:
        self.exact = False
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current VmRSS (Linux >= 4.0)
            self.exact = _status_kib("VmHWM") is not None
        except OSError:
            pass
        self.before = _status_kib("VmRSS") * 1024 if self.exact else maxrss_bytes()

    def stop(self) -> int:
        peak = _status_kib("VmHWM") * 1024 if self.exact else maxrss_bytes()
        return max(peak - self.before, 0)


def run_child(script: str, args: Sequence[str], timeout: float = 600.0) -> dict:
    """Run ``python script *args`` in a fresh process; it must print one JSON object last."""
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine_line() -> str:
    """One line describing where the numbers were measured."""
    import torch

    return (
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads, Python {platform.python_version()}"
    )


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)
