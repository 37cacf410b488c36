"""Run directories: one layout for every ``lapheads train ...`` command.

::

    RUN_DIR/
        config.yaml        the resolved config (recipe name included); rebuilds the run
        meta.json          git revision, versions, command line, world size, start time
        metrics.jsonl      one JSON object per logged step / evaluation
        tb/                TensorBoard events
        checkpoints/       crash-safe checkpoints (see engine.checkpoint)
        final/             model.safetensors + model.json (what rebuilds the model), at the end

A run directory is never overwritten: starting a run where ``config.yaml`` already exists needs
``--resume`` (continue it) or ``--overwrite`` (delete it first). ``--resume`` also checks that the
config did not change in ways that would break exact resume.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import yaml

from ..errors import CheckpointError, ConfigError
from .checkpoint import atomic_write_text
from .config import to_dict


def git_revision() -> Optional[str]:
    """The git commit of the lapheads source tree (with ``-dirty``), or None outside git."""
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def add_train_args(p: argparse.ArgumentParser, default_config: Optional[str] = None) -> None:
    """The flags every ``lapheads train ...`` command shares."""
    p.add_argument("--config", default=default_config,
                   help="YAML recipe (see recipes/); values can be overridden with --set")
    p.add_argument("--out", required=True, help="run directory to create (or continue with --resume)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest complete checkpoint")
    p.add_argument("--overwrite", action="store_true", help="delete an existing --out first")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.max_steps=100 "
                        "--set model.laplacian_heads=all (repeatable)")


# Keys that may differ between the original run and a --resume (they do not change the math).
RESUME_MUTABLE = {"train.max_steps", "train.log_every", "train.eval_every", "train.ckpt_every",
                  "train.keep_checkpoints", "train.progress", "train.num_workers", "train.device"}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


class RunDir:
    """A run directory (see module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    config_path = property(lambda self: self.path / "config.yaml")
    metrics_path = property(lambda self: self.path / "metrics.jsonl")
    ckpt_dir = property(lambda self: self.path / "checkpoints")
    final_dir = property(lambda self: self.path / "final")
    tb_dir = property(lambda self: self.path / "tb")

    def exists(self) -> bool:
        return self.config_path.is_file()

    def prepare(self, cfg: Any, recipe: str, *, resume: bool, overwrite: bool, is_main: bool = True,
                write: bool = True) -> None:
        """Create (or check, on resume) the directory and write ``config.yaml`` + ``meta.json``.

        Raises before any training work when the directory would be overwritten or the config
        of a resumed run changed. With ``write=False`` it only checks (nothing is touched), so a
        caller can validate data before the first file is written.
        """
        if resume and overwrite:
            raise ConfigError("--resume and --overwrite exclude each other")
        resolved = {"recipe": recipe, **to_dict(cfg)}
        if resume:
            if not self.exists():
                raise CheckpointError(f"--resume: {self.path} is not a run directory (no config.yaml)")
            old = yaml.safe_load(self.config_path.read_text(encoding="utf-8")) or {}
            a, b = _flatten(old), _flatten(resolved)
            changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in RESUME_MUTABLE)
            if changed:
                k = changed[0]
                raise ConfigError(
                    f"--resume: the config differs from {self.config_path} at {k} "
                    f"({a.get(k)!r} -> {b.get(k)!r}); exact resume needs the same config")
        else:
            if self.path.exists() and any(self.path.iterdir()):
                if not overwrite:
                    raise CheckpointError(
                        f"{self.path} already holds a run; pass --resume to continue it or "
                        f"--overwrite to replace it")
                if is_main and write:
                    shutil.rmtree(self.path)
        if not is_main or not write:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.config_path, yaml.safe_dump(resolved, sort_keys=False))
        meta_path = self.path / "meta.json"
        meta = json.loads(meta_path.read_text()) if (resume and meta_path.is_file()) else {}
        import torch
        meta.setdefault("starts", []).append({
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "argv": sys.argv,
            "git_revision": git_revision(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "host": platform.node(),
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "resume": resume,
        })
        meta["recipe"] = recipe
        meta["git_revision"] = meta["starts"][0]["git_revision"]
        atomic_write_text(meta_path, json.dumps(meta, indent=1))

    def read_config(self) -> dict:
        if not self.exists():
            raise CheckpointError(f"{self.path} is not a run directory (no config.yaml)")
        data = yaml.safe_load(self.config_path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or "recipe" not in data:
            raise CheckpointError(f"{self.config_path} has no 'recipe' field")
        return data

    def metrics(self) -> list[dict]:
        """All records of ``metrics.jsonl`` (a torn last line of a killed run is skipped)."""
        if not self.metrics_path.is_file():
            return []
        out = []
        for line in self.metrics_path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out
