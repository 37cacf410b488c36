"""Run every benchmark in this folder and write benchmarks/RESULTS.md (``make bench``).

Each ``benchmarks/*.py`` except this file, ``_common.py`` and ``__init__.py`` runs as its own
subprocess (so one benchmark's memory and threads never disturb another), with ``--quick``
passed through when given. A benchmark prints one Markdown section on stdout (progress goes to
stderr, shown live); the sections are collected in file-name order under a header with the date
and the machine. A benchmark that fails still gets a section saying so, and the exit status is 1.

Usage: ``python benchmarks/run_all.py [--quick] [--only NAME ...] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SKIP = {"run_all.py", "_common.py", "__init__.py"}


def discover(only: list[str] | None = None) -> list[Path]:
    """The benchmark scripts, sorted by name (optionally only those named, with or without .py)."""
    scripts = sorted(p for p in HERE.glob("*.py") if p.name not in SKIP and not p.name.startswith("_"))
    if only:
        wanted = {n if n.endswith(".py") else n + ".py" for n in only}
        unknown = wanted - {p.name for p in scripts}
        if unknown:
            raise SystemExit(
                f"run_all.py: unknown benchmark(s) {sorted(unknown)}; available: {[p.name for p in scripts]}"
            )
        scripts = [p for p in scripts if p.name in wanted]
    return scripts


def run_one(script: Path, quick: bool, timeout: float) -> tuple[str, bool, float]:
    """Run one benchmark; return (its Markdown section, success, seconds)."""
    cmd = [sys.executable, str(script)] + (["--quick"] if quick else [])
    start = time.time()
    try:
        # stderr is inherited so progress shows live; stdout is the section.
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout, cwd=HERE.parent)
    except subprocess.TimeoutExpired:
        return f"## {script.stem}\n\nFAILED: timed out after {timeout:.0f} s.\n", False, time.time() - start
    secs = time.time() - start
    out = proc.stdout.strip()
    if proc.returncode != 0:
        return (
            (
                f"## {script.stem}\n\nFAILED with exit status {proc.returncode}; its output:\n\n```\n"
                f"{out[-3000:]}\n```\n"
            ),
            False,
            secs,
        )
    if not out.startswith("#"):
        out = f"## {script.stem}\n\n{out}"
    return out + "\n", True, secs


def machine() -> str:
    import platform

    import torch

    return (
        f"{platform.node() or 'unknown host'}: {platform.machine()} {platform.system()} {platform.release()}, "
        f"{os.cpu_count()} CPUs, {platform.processor() or 'unknown CPU'}, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="pass --quick to every benchmark (smoke run)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks (file names)")
    ap.add_argument("--out", type=Path, default=HERE / "RESULTS.md", help="where to write the report")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per benchmark")
    args = ap.parse_args(argv)

    scripts = discover(args.only)
    if not scripts:
        print("run_all.py: no benchmarks found", file=sys.stderr)
        return 1
    sections, ok_all = [], True
    for script in scripts:
        print(f"[run_all] {script.name}{' --quick' if args.quick else ''}", file=sys.stderr, flush=True)
        section, ok, secs = run_one(script, args.quick, args.timeout)
        ok_all &= ok
        sections.append(section + f"\n_{script.name}: {secs:.0f} s_\n")
        print(section, flush=True)
    header = (
        f"# lapheads benchmarks\n\nDate: {dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}  \n"
        f"Machine: {machine()}  \nCommand: `python benchmarks/run_all.py{' --quick' if args.quick else ''}`"
        f"{' (quick mode: smaller sizes, not the reference numbers)' if args.quick else ''}\n"
    )
    args.out.write_text(header + "\n" + "\n".join(sections))
    print(f"[run_all] wrote {args.out}", file=sys.stderr)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
