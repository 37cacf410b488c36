"""CPU thread count under load: a digits-recipe training step, idle and beside a competing process.

Question (shared machines): with other work on the machine, does the engine's automatic
thread count (``train.threads: 0``, see ``src/lapheads/engine/threads.py``) keep a tiny model's
step time from collapsing, where torch's default (one thread per core) does not?

Method: each measurement runs in a fresh subprocess (so thread pools start clean) that builds the
digits recipe's model (the shipped ``classify/digits`` config: ViT, 4 layers x 64, 4 heads, all
Laplacian) and times full training steps (forward, backward, AdamW) on a batch of 64 images,
median over the steps after warm-up. Policies:

* ``torch default``: ``torch.get_num_threads()`` of a fresh process with no ``OMP_NUM_THREADS``
  (one thread per core);
* ``auto``: :func:`lapheads.engine.threads.choose_threads` evaluated in that child, under the same
  conditions (it measures the other processes' CPU use over 0.15 s).

Conditions: idle, and beside one competing process (a fresh Python running the same model's
training steps with torch's default threads, i.e. a second run someone started on the machine).
The competitor starts first and runs for the whole measurement. Printed: ms per step and the
ratio loaded / idle per policy; the ratio is the figure of merit (both are measured in this run).

Usage: ``python benchmarks/threads.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, markdown_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, statistics, sys, time
import torch
from lapheads.engine.config import load_config
from lapheads.engine.threads import choose_threads
from lapheads.recipes.classify import ClassifyConfig, build_model
policy, steps, forever = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "forever"
if policy == "auto":
    n, why = choose_threads(0)
    torch.set_num_threads(n)
else:
    n, why = torch.get_num_threads(), "torch default"
cfg = load_config(ClassifyConfig, sys.argv[4], [], recipe="classify")
torch.manual_seed(0)
model = build_model(cfg.model, 10)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(64, 3, cfg.model.img_size, cfg.model.img_size)
y = torch.randint(0, 10, (64,))
times = []
i = 0
while forever or i < steps:
    t0 = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    times.append(time.perf_counter() - t0)
    i += 1
warm = max(1, steps // 5)
print(json.dumps({"threads": n, "why": why, "ms": 1e3 * statistics.median(times[warm:])}))
"""


def _env() -> dict:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # both policies decide for themselves
    env.pop("MKL_NUM_THREADS", None)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def measure(policy: str, steps: int, config: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, policy, str(steps), "once", config],
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (a smoke test of the script)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per measurement (default 60, quick 15)")
    ap.add_argument(
        "--config", default=str(ROOT / "src" / "lapheads" / "recipes" / "configs" / "classify" / "digits.yaml")
    )
    args = ap.parse_args()
    steps = args.steps or (15 if args.quick else 60)
    policies = ["torch default", "auto"]
    res: dict[str, dict[str, dict]] = {p: {} for p in policies}
    for p in policies:
        print(f"[threads] idle, {p} ...", file=sys.stderr, flush=True)
        res[p]["idle"] = measure("default" if p == "torch default" else "auto", steps, args.config)
    comp = subprocess.Popen(
        [sys.executable, "-c", CHILD, "default", "0", "forever", args.config],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        time.sleep(5.0)  # the competitor imports torch and reaches its training loop
        for p in policies:
            print(f"[threads] beside a competing run, {p} ...", file=sys.stderr, flush=True)
            res[p]["loaded"] = measure("default" if p == "torch default" else "auto", steps, args.config)
    finally:
        comp.kill()
        comp.wait()
    rows = []
    for p in policies:
        i, l = res[p]["idle"], res[p]["loaded"]
        rows.append(
            [p, f"{i['threads']} / {l['threads']}", f"{i['ms']:.1f}", f"{l['ms']:.1f}", f"{l['ms'] / i['ms']:.2f}"]
        )
    print("## threads\n")
    print(f"{machine_line()}\n")
    print(
        f"Digits-recipe training step (batch 64), median of {steps} steps after warm-up, each in a fresh "
        f"process; 'loaded' = beside one competing training process with torch's default threads.\n"
    )
    print(markdown_table(["policy", "threads idle / loaded", "idle ms/step", "loaded ms/step", "loaded / idle"], rows))
    d, a = res["torch default"]["loaded"]["ms"], res["auto"]["loaded"]["ms"]
    print(f"\nUnder load, auto / torch default = {a / d:.2f} (lower is better).")


if __name__ == "__main__":
    main()
