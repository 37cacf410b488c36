"""Crash-safe checkpoints that cannot run code.

Layout of ``checkpoints/`` in a run directory::

    checkpoints/step_00000100/
        model.safetensors     weights of the trained module
        ema.safetensors       EMA weights (when EMA is on)
        extra.safetensors     tensors the recipe keeps (e.g. DINO's teacher and center)
        state.pt              optimizer states, RNG states, step (torch.load(weights_only=True))
        state.json            step, time, metrics summary (human-readable)
    checkpoints/latest        name of the newest complete checkpoint

Under ``train.parallel: fsdp`` model and optimizer state are DCP shards instead (``dcp/``, every
rank writes its own; see engine.fsdp), next to ``state.pt`` (step, RNG states) and
``extra.safetensors`` written by rank 0.

Design choices:

* Atomic: a checkpoint is written into ``.tmp-step_X``, every file fsynced, then renamed into
  place, and only then ``latest`` is replaced (write + fsync + ``os.replace``). A kill at any
  moment leaves either the old or the new checkpoint, never a partial one that ``latest`` names.
  With several writers (FSDP) rank 0 creates the temporary directory (:func:`begin_checkpoint`),
  every rank writes into it, and rank 0 renames it and moves ``latest`` after a barrier
  (:func:`commit_checkpoint`).
* Safe: tensors go through safetensors; everything else through ``torch.load(weights_only=True)``,
  which refuses pickled code (a crafted payload raises instead of executing).
* Loading weights into the wrong architecture lists the missing, unexpected and mis-shaped keys.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError

LATEST = "latest"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so readers see the old or the new content, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _contiguous(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses shared storage and non-contiguous tensors; clone what needs it.
    out, seen = {}, set()
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise CheckpointError(f"state entry {k!r} is a {type(v).__name__}, not a tensor")
        t = v.detach().cpu()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen or not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone().contiguous()
        seen.add(key)
        out[k] = t
    return out


def save_tensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Optional[dict] = None) -> None:
    save_file(_contiguous(tensors), str(path), metadata={k: str(v) for k, v in (metadata or {}).items()})


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{path} is not a valid safetensors file ({' '.join(str(e).split())[:200]})") from None


def safe_torch_load(path: Path) -> Any:
    """``torch.load`` that only accepts tensors and plain containers (no code)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol: not one clean line
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        msg = " ".join(str(e).split())
        # torch's text is a paragraph of advice ending in the real reason; keep only the reason
        bad = re.search(r"WeightsUnpickler error: (.*?)(?: Check the documentation|$)", msg)
        why = (f"it holds something other than tensors and plain containers ({bad.group(1).strip()}), "
               f"e.g. a pickled object that could run code; it was not loaded" if bad else msg[:300])
        raise CheckpointError(f"{path} was refused by the safe loader (weights_only=True): {why}") from None


def load_weights(module: torch.nn.Module, state: Mapping[str, torch.Tensor], source: str = "checkpoint",
                 strict: bool = True) -> None:
    """``load_state_dict`` with an error listing every mismatched key (wrong architecture)."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if strict and (missing or unexpected or shapes):
        def _fmt(xs: list[str]) -> str:
            return ", ".join(xs[:8]) + (f" (+{len(xs) - 8} more)" if len(xs) > 8 else "")
        parts = []
        if missing:
            parts.append(f"missing keys: {_fmt(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_fmt(unexpected)}")
        if shapes:
            parts.append(f"shape mismatches: {_fmt(shapes)}")
        raise CheckpointError(f"{source} does not fit this model architecture; " + "; ".join(parts))
    module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=strict)


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step_"))


def latest_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    """The newest COMPLETE checkpoint (the one ``latest`` names), or None."""
    ckpt_dir = Path(ckpt_dir)
    pointer = ckpt_dir / LATEST
    if pointer.is_file():
        name = pointer.read_text(encoding="utf-8").strip()
        cand = ckpt_dir / name
        if cand.is_dir() and (cand / "state.pt").is_file():
            return cand
        raise CheckpointError(f"{pointer} names {name!r}, which is missing or incomplete")
    return None


def begin_checkpoint(ckpt_dir: Path, step: int) -> Path:
    """Create the empty temporary directory of step ``step``'s checkpoint (rank 0 only).

    Under ``parallel: fsdp`` every rank then writes its shards into it, and after a barrier rank 0
    calls :func:`commit_checkpoint`; ``latest`` never names a checkpoint some rank has not finished.
    """
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / f".tmp-step_{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def write_files(directory: Path, files: Mapping[str, Any]) -> None:
    """Write ``*.safetensors`` (dicts of tensors) and ``*.pt`` (weights-only objects), each fsynced."""
    for fname, content in files.items():
        path = Path(directory) / fname
        if fname.endswith(".safetensors"):
            save_tensors(path, content)
        elif fname.endswith(".pt"):
            torch.save(content, path)
        else:
            raise CheckpointError(f"unsupported checkpoint file type {fname}")
        _fsync_file(path)


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*"), reverse=True):  # files first, then their directories
        if p.is_file():
            _fsync_file(p)
        else:
            _fsync_dir(p)


def commit_checkpoint(ckpt_dir: Path, tmp: Path, step: int, keep: int = 2, summary: Optional[dict] = None) -> Path:
    """Publish a complete temporary checkpoint directory: ``state.json``, rename, move ``latest``.

    Every file under ``tmp`` is fsynced again (shards other ranks wrote included), then ``tmp`` is
    renamed to ``step_X`` and only then ``latest`` is replaced; older checkpoints beyond ``keep``
    and stale temporary directories of killed processes are removed afterwards.
    """
    ckpt_dir = Path(ckpt_dir)
    info = {"step": step, "time": time.time(), **(summary or {})}
    (tmp / "state.json").write_text(json.dumps(info, indent=1, default=float), encoding="utf-8")
    _fsync_tree(tmp)
    _fsync_dir(tmp)
    name = f"step_{step:08d}"
    final = ckpt_dir / name
    if final.exists():  # a re-run of the same step after a crash between rename and pointer
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_dir)
    atomic_write_text(ckpt_dir / LATEST, name)
    for old in list_checkpoints(ckpt_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in ckpt_dir.glob(".tmp-*"):  # partial writes of killed processes
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    for stale in ckpt_dir.glob(f".{LATEST}.tmp-*"):  # a pointer write killed before its rename
        stale.unlink(missing_ok=True)
    return final


def write_checkpoint(ckpt_dir: Path, step: int, files: Mapping[str, Any], keep: int = 2,
                     summary: Optional[dict] = None) -> Path:
    """Write one checkpoint atomically (one writer: :func:`begin_checkpoint` + files + commit).

    Args:
        files: name -> content; ``*.safetensors`` take a dict of tensors, ``state.pt`` any
            weights-only-loadable object.
        keep: how many complete checkpoints to keep (older ones are removed afterwards).
    """
    tmp = begin_checkpoint(ckpt_dir, step)
    write_files(tmp, files)
    return commit_checkpoint(ckpt_dir, tmp, step, keep=keep, summary=summary)
