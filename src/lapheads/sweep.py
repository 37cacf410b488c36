"""``lapheads sweep``: one recipe over a grid of config values, Laplacian-head settings and seeds.

``lapheads sweep --config classify/digits --laplacian-heads 0,2,all --seeds 0,1,2 --out runs/digits_sweep
[--grid model.embed_dim=32,64] [--point model.depth=2,train.max_steps=50]``: every grid point is an ordinary
run directory ``OUT/[<axis>=<value>__...__]lap<k>_seed<s>`` made by ``lapheads train`` (docs/reports.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from tqdm.auto import tqdm

from .engine.config import load_config, to_dict
from .engine.run import FINISHED_MUTABLE, RESUME_MUTABLE, RunDir, config_changes, describe_changes, lock_dir
from .engine.slurm import LauncherConfig, submit_sweep
from .engine.threads import available_cpus
from .errors import ConfigError, DiskFullError, RunFailed, is_disk_full
from .heads import LaplacianHeads
from .recipes import get_recipe

SWEEP_HINT = "pass --restart-changed to train them afresh, --overwrite to restart every run, or choose another --out"


# the axes a sweep sets itself (a retrofit's heads are the top-level `laplacian_heads`)
RESERVED_AXES = {
    "model.laplacian_heads": "--laplacian-heads",
    "laplacian_heads": "--laplacian-heads",
    "train.seed": "--seeds",
}
_SAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def run_name(k: str, seed: int, values: Optional[dict[str, str]] = None, short: Optional[dict[str, str]] = None) -> str:
    """``lap<k>_seed<s>``, prefixed by ``<axis>=<value>__`` per config axis of ``values`` (sorted by key)."""
    parts = [f"{(short or {}).get(key, key)}={_value_slug(values[key])}" for key in sorted(values or {})]
    return "__".join(parts + [f"lap{k}_seed{seed}"])


def _value_slug(raw: str) -> str:
    """A value as it may appear in a directory name: itself when safe, else cleaned + hash of the exact text."""
    raw = raw.strip()
    if raw and not _SAFE.search(raw) and len(raw) <= 40:
        return raw
    clean, digest = _SAFE.sub("-", raw).strip("-")[:32], hashlib.sha256(raw.encode()).hexdigest()
    return f"{clean}-{digest[:6]}" if clean else digest[:8]


def axis_names(keys: Sequence[str]) -> dict[str, str]:
    """Short names of the axes: the last component of the key, or the full key when two share it."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def split_top(text: str) -> list[str]:
    """Split at commas outside brackets/braces/quotes: ``"1,[2,3],'a,b'"`` -> ``["1", "[2,3]", "'a,b'"]``."""
    out, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur).strip())
    return out


def _check_key(key: str, flag: str, item: str, overrides: Sequence[str]) -> str:
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"{flag} {item!r} must look like section.key=VALUE (e.g. model.embed_dim=64)")
    if key in RESERVED_AXES:
        raise ConfigError(f"{flag} {item!r}: {key} is the {RESERVED_AXES[key]} axis; give it there")
    if any(o.split("=", 1)[0].strip() == key for o in overrides):
        raise ConfigError(f"{flag} {item!r}: {key} is also set with --set; keep it in one place")
    return key


def parse_grid(items: Sequence[str], overrides: Sequence[str] = ()) -> list[tuple[str, list[str]]]:
    """``["model.embed_dim=64,128"]`` -> ``[("model.embed_dim", ["64", "128"])]``; keys unique."""
    axes: dict[str, list[str]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--grid {item!r} must look like KEY=V1,V2 (e.g. model.embed_dim=64,128)")
        key = _check_key(key, "--grid", item, overrides)
        values = split_top(raw)
        if any(not v for v in values):
            raise ConfigError(f"--grid {item!r} has an empty value")
        if key in axes:
            raise ConfigError(f"--grid {key} is given twice; list all its values in one --grid")
        axes[key] = list(dict.fromkeys(values))
    return list(axes.items())


def parse_point(item: str, overrides: Sequence[str] = ()) -> dict[str, str]:
    """``"model.embed_dim=64,train.max_steps=100"`` -> ``{"model.embed_dim": "64", "train.max_steps": "100"}``."""
    point: dict[str, str] = {}
    for part in split_top(item):
        key, sep, raw = part.partition("=")
        if not sep or not raw.strip():
            raise ConfigError(f"--point {item!r}: {part!r} must look like KEY=VALUE; separate pairs with commas")
        key = _check_key(key, "--point", item, overrides)
        if key in point:
            raise ConfigError(f"--point {item!r} sets {key} twice")
        point[key] = raw.strip()
    return point


def design_points(
    grid: Sequence[tuple[str, Sequence[str]]] = (), points: Sequence[dict[str, str]] = ()
) -> list[dict[str, str]]:
    """The cross product of ``grid`` plus the explicit ``points``, each once, in that order."""
    keys = [k for k, _ in grid]
    product = itertools.product(*[v for _, v in grid]) if grid or not points else ()
    design = [dict(zip(keys, combo)) for combo in product]
    for p in points:
        if p not in design:
            design.append(dict(p))
    return design


def parse_heads_list(text: str) -> list[str]:
    """``"0,2,all"`` -> ``["0", "2", "all"]``, each a valid head setting (:func:`check_distinct_heads` refuses repeats).

    Raises:
        ConfigError: empty, or an invalid setting.
    """
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ConfigError(f"--laplacian-heads {text!r} is empty; give e.g. 0,3,all")
    for t in items:
        LaplacianHeads(t)  # validates (int >= 0, all, none)
    return items


def check_distinct_heads(heads: Sequence[str], same: Callable[[str, object, object], bool]) -> None:
    """Refuse two spellings of one head setting (``0,none``, ``1,01``, ``0,0``: one run by ``same``, the
    recipe's :meth:`~lapheads.recipes.base.Recipe.same_setting`) with a one-line ConfigError."""
    for i, a in enumerate(heads):
        for b in heads[:i]:
            if same("model.laplacian_heads", LaplacianHeads(b).to_config(), LaplacianHeads(a).to_config()):
                what = f"{b!r} is given twice" if a == b else f"{b!r} and {a!r} are the same setting"
                raise ConfigError(f"--laplacian-heads {','.join(heads)!r}: {what} (one run); give each setting once")


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``, each seed once.

    Raises:
        ConfigError: not integers, empty, or a seed given twice (``0,0``: one run).
    """
    try:
        seeds = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {text!r} must be comma-separated integers, e.g. 0,1,2") from None
    if not seeds:
        raise ConfigError("--seeds is empty")
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise ConfigError(f"--seeds {text!r} gives seed {twice[0]} twice (one run); give each seed once")
    return seeds


@dataclass
class GridRun:
    """One grid point: its directory, its ``lapheads train`` flags, and how it stands."""

    path: Path
    sets: list[str]
    state: str  # RunDir.state(): done, partial or new
    resolved: dict = field(default_factory=dict)  # the config this sweep would write
    existing: dict = field(default_factory=dict)  # the config.yaml already there
    changes: list[str] = field(default_factory=list)  # keys that differ beyond what may differ


def plan_grid(
    recipe: str,
    config: Optional[str],
    heads: Sequence[str],
    seeds: Sequence[int],
    out: Path,
    overrides: Sequence[str] = (),
    design: Sequence[dict[str, str]] = ({},),
) -> list[GridRun]:
    """Every run of the design x k x seeds with its state and, for existing runs, the config keys that changed.

    Raises:
        ConfigError: a design point's config does not load (unknown key, bad value), before anything runs.
    """
    rec = get_recipe(recipe)
    cfg_cls = rec.config_type
    check_distinct_heads(heads, rec.same_setting)
    short = axis_names(sorted({k for p in design for k in p}))
    defaults = to_dict(cfg_cls())
    plan = []
    for point in design:
        point_sets = [f"{k}={v}" for k, v in point.items()]
        if point:
            try:
                load_config(cfg_cls, config, [*point_sets, *overrides], recipe=recipe)
            except ConfigError as e:
                raise ConfigError(f"grid point {', '.join(point_sets)}: {e}") from None
        for k in heads:
            for seed in seeds:
                sets = [f"{rec.heads_key}={k}", f"train.seed={seed}", *point_sets, *overrides]
                path = out / run_name(k, seed, point, short)
                run = GridRun(path, sets, RunDir(path).state())
                if run.state != "new":
                    run.resolved = {"recipe": recipe, **to_dict(load_config(cfg_cls, config, sets, recipe=recipe))}
                    run.existing = RunDir(run.path).read_config()
                    allowed = FINISHED_MUTABLE if run.state == "done" else RESUME_MUTABLE
                    run.changes = config_changes(
                        run.existing, run.resolved, allowed, {"recipe": recipe, **defaults}, same=rec.same_setting
                    )
                plan.append(run)
    return plan


def check_plan(
    plan: Sequence[GridRun],
    out: Path,
    config: Optional[str],
    *,
    overwrite: bool = False,
    restart_changed: bool = False,
    hint: str = SWEEP_HINT,
) -> list[GridRun]:
    """The runs of ``plan`` to delete and train afresh, every one checked before the first goes.

    Raises:
        ConfigError: existing runs were made with other settings and neither flag is given (one line).
        CheckpointError: a run to delete holds files that are not the run's own, the working directory
            or the ``config`` (:meth:`~lapheads.engine.run.RunDir.check_overwrite`).
    """
    changed = [r for r in plan if r.changes]
    if changed and not (overwrite or restart_changed):
        keys = sorted({k for r in changed for k in r.changes})
        first = changed[0]
        raise ConfigError(
            f"{len(changed)} existing run(s) in {out} ({', '.join(r.path.name for r in changed)}) were made "
            f"with other settings than this command's: {', '.join(keys)} (e.g. {first.path.name}: "
            f"{describe_changes(first.existing, first.resolved, first.changes, limit=3)}); {hint}"
        )
    restart = [r for r in plan if r.state != "new" and (overwrite or r.changes)]
    for r in restart:
        flag = "--overwrite" if overwrite else "--restart-changed"
        RunDir(r.path).check_overwrite(keep=[config] if config else [], flag=flag)
    return restart


def delete_runs(runs: Sequence[GridRun], quiet: bool = False) -> None:
    """Delete the files of the grid runs :func:`check_plan` returned, each under its lock (so never
    under a live writer); nothing but the runs' own files goes (engine.run.RunDir.clear)."""
    for r in runs:
        if not quiet:
            why = f"settings changed: {', '.join(r.changes)}" if r.changes else "--overwrite"
            print(f"[sweep] {r.path.name}: deleted to start afresh ({why})")
        with lock_dir(r.path):
            RunDir(r.path).clear()
        with contextlib.suppress(OSError):
            r.path.rmdir()
        r.state = "new"


def run_grid(
    recipe: str,
    config: Optional[str],
    heads: Sequence[str],
    seeds: Sequence[int],
    out: Path,
    overrides: Sequence[str] = (),
    quiet: bool = False,
    *,
    overwrite: bool = False,
    restart_changed: bool = False,
    hint: str = SWEEP_HINT,
    design: Sequence[dict[str, str]] = ({},),
    jobs: int = 1,
    launcher: Optional[LauncherConfig] = None,
    slurm_folder: Optional[str] = None,
    wait: bool = True,
    on_start: Optional[Callable[[], None]] = None,
) -> list[Path]:
    """Train every (design point, k, seed) run that is not finished yet; returns the run directories.

    Args:
        overwrite, restart_changed: retrain every existing run / those made with other settings
            (else those raise a ConfigError ending with ``hint`` before anything runs).
        jobs: runs trained at once, each a ``lapheads train`` subprocess.
        launcher: ``--launcher slurm``: one SLURM array job instead (:func:`lapheads.engine.slurm.submit_sweep`;
            ``wait``: until it ends).
        on_start: runs once the plan is accepted, before anything in ``out`` changes.
    """
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: expected a positive number of runs at once")
    rec = get_recipe(recipe)
    with lock_dir(out):
        plan = plan_grid(recipe, config, heads, seeds, out, overrides, design)
        restart = check_plan(plan, out, config, overwrite=overwrite, restart_changed=restart_changed, hint=hint)
        if on_start is not None:
            on_start()
        delete_runs(restart, quiet)
        for r in plan:
            if r.state == "done" and not quiet:
                print(f"[sweep] {r.path.name}: finished, skipped")
        todo = [r for r in plan if r.state != "done"]
        if launcher is not None and todo:
            argvs = [(r.path, train_command(recipe, config, r)[5:], r.state == "partial") for r in todo]
            submit_sweep(recipe, argvs, out, launcher, slurm_folder, wait=wait, quiet=quiet)
        elif jobs > 1 and len(todo) > 1:
            _train_in_subprocesses(recipe, config, todo, out, min(jobs, len(todo)), quiet)
        else:
            for r in todo:
                if not quiet:
                    print(f"[sweep] {r.path.name}: {'resuming' if r.state == 'partial' else 'training'}")
                cfg = load_config(rec.config_type, config, r.sets, recipe=recipe)
                res = rec.train(cfg, r.path, resume=r.state == "partial")
                for line in rec.result_lines(res, r.path):
                    print(line)
    return [r.path for r in plan]


def train_command(recipe: str, config: Optional[str], run: GridRun) -> list[str]:
    """The ``lapheads train`` command line of one grid run (``--resume`` when it has started)."""
    cmd = [sys.executable, "-m", "lapheads.cli", "train", recipe, "--out", str(run.path)]
    cmd += ["--config", str(config)] if config else []
    cmd += [arg for s in run.sets for arg in ("--set", s)]
    return cmd + (["--resume"] if run.state == "partial" else [])


def _train_in_subprocesses(
    recipe: str, config: Optional[str], todo: Sequence[GridRun], out: Path, jobs: int, quiet: bool
) -> None:
    """Train ``todo`` with ``jobs`` ``lapheads train`` subprocesses at a time."""
    threads = max(1, available_cpus() // jobs)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("RANK", None)  # a sweep started under torchrun still runs single-process children
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"[sweep] {len(todo)} runs, {jobs} at a time ({threads} thread(s) each); logs in {logs}", flush=True)
    pending, running, failed = list(todo), {}, []
    bar = tqdm(total=len(todo), desc="runs", unit="run", disable=True if quiet else None)
    try:
        while pending or running:
            while pending and len(running) < jobs and not failed:
                r = pending.pop(0)
                log_path = logs / f"{r.path.name}.log"
                cmd = train_command(recipe, config, r)
                try:
                    with open(log_path, "a") as head:
                        head.write(f"# {' '.join(cmd[1:])}\n")
                    log = open(log_path, "a")
                except OSError as e:  # a full disk: this run fails in one line, the running ones end first
                    if not is_disk_full(e):
                        raise
                    full = DiskFullError(
                        logs, None, what=f"the log {log_path.name}", run=out, resume="the same lapheads sweep command"
                    )
                    failed.append((r, log_path, str(full)))
                    continue
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
                running[proc] = (r, log, log_path, time.time())
                if not quiet:
                    tqdm.write(f"[sweep] {r.path.name}: {'resuming' if r.state == 'partial' else 'training'}")
            if not running:
                break
            time.sleep(0.2)
            for proc in [p for p in running if p.poll() is not None]:
                r, log, log_path, t0 = running.pop(proc)
                log.close()
                text = log_path.read_text(errors="replace").splitlines()
                if proc.returncode != 0:
                    errors = [t for t in text if t.startswith("lapheads ")] or text[-1:]
                    failed.append((r, log_path, errors[-1] if errors else f"exit status {proc.returncode}"))
                    continue
                bar.update(1)
                if not quiet:
                    tqdm.write(f"[sweep] {r.path.name}: done in {time.time() - t0:.0f} s")
                    for line in text[[i for i, t in enumerate(text) if t.startswith("# ")][-1] + 1 :]:
                        if line.startswith(("final", "->", "run directory")):
                            tqdm.write(line)
    except KeyboardInterrupt as e:  # Ctrl-C / SIGTERM: every run stops at a step with a checkpoint
        signum = getattr(e, "signum", signal.SIGINT)
        for proc in running:
            if proc.poll() is None:
                proc.send_signal(signum)
        for proc, (_, log, _, _) in running.items():
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
        raise
    finally:
        bar.close()
    if failed:
        failed.sort(key=lambda f: todo.index(f[0]))  # the first in the plan's order
        r, log_path, line = failed[0]
        more = f" ({len(failed) - 1} more failed)" if len(failed) > 1 else ""
        raise RunFailed(
            f"run {r.path.name} failed{more}: {line} (log: {log_path}); once that is "
            "fixed, the same sweep command resumes the unfinished runs"
        )
