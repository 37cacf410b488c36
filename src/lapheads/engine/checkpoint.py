"""Crash-safe, verifiable checkpoints that cannot run code (design notes: docs/design/engine.md, Checkpoints)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Collection, Iterator, Mapping, Optional

import torch
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError, DiskFullError, free_bytes, is_disk_full
from ..outputs import atomic_write
from ..outputs import fsync_dir as _fsync_dir  # the name the fault-injection tests slow down

LATEST = "latest"
STATE_JSON = "state.json"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def removed_on_failure(tmp: Path, directory: Path, what: str, needed: Optional[int] = None) -> Iterator[None]:
    """Remove ``tmp`` (file or directory) when the block fails (a signal included); a full disk becomes
    :class:`DiskFullError` naming ``directory``, ``what`` and ``needed`` bytes."""
    try:
        yield
    except BaseException as e:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                tmp.unlink()
        if is_disk_full(e) and not isinstance(e, DiskFullError):
            raise DiskFullError(directory, needed, what=what) from None
        raise


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
    """``safetensors`` ``save_file``; a full disk raises ``OSError(ENOSPC)`` (safetensors says it in text)."""
    try:
        save_file(_contiguous(tensors), str(path), metadata={k: str(v) for k, v in (metadata or {}).items()})
    except Exception as e:
        if not isinstance(e, OSError) and is_disk_full(e):
            raise OSError(errno.ENOSPC, "No space left on device", str(path)) from None
        raise


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
        why = (
            f"it holds something other than tensors and plain containers ({bad.group(1).strip()}), "
            f"e.g. a pickled object that could run code; it was not loaded"
            if bad
            else msg[:300]
        )
        raise CheckpointError(f"{path} was refused by the safe loader (weights_only=True): {why}") from None


def _fits(checkpoint: tuple[int, ...], model: tuple[int, ...]) -> bool:
    return checkpoint == model or (model[:1] == (1,) and checkpoint == model[1:])


def load_weights(
    module: torch.nn.Module, state: Mapping[str, torch.Tensor], source: str = "checkpoint", strict: bool = True
) -> None:
    """``load_state_dict`` with an error listing every mismatched key (wrong architecture).

    When only missing keys are reported the module has been loaded before the error; discard it.
    """
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    # an entry the model saves with a leading axis of one (lapheads.timm's marked projections) takes the
    # plain shape too: the module's own load hook reads both, and refuses what does not fit
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and not _fits(tuple(state[k].shape), tuple(own[k].shape))
    ]

    def refuse(missing: list[str]) -> CheckpointError:
        found = {"missing keys": missing, "unexpected keys": unexpected, "shape mismatches": shapes}
        parts = [
            f"{what}: {', '.join(xs[:8])}" + (f" (+{len(xs) - 8} more)" if len(xs) > 8 else "")
            for what, xs in found.items()
            if xs
        ]
        return CheckpointError(f"{source} does not fit this model architecture; " + "; ".join(parts))

    if strict and (unexpected or shapes):
        raise refuse(missing)
    try:
        result = module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    except RuntimeError as e:  # a module's own load hook refused its entries
        raise CheckpointError(f"{source} does not fit this model: {' '.join(str(e).split())}") from None
    if strict and result.missing_keys:
        raise refuse(list(result.missing_keys))


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step_"))


def checkpoint_step(path: Path) -> Optional[int]:
    """The step of a checkpoint directory ``step_00000020`` (None for another name)."""
    m = re.fullmatch(r"step_(\d+)", Path(path).name)
    return int(m.group(1)) if m else None


def last_good_step(ckpt_dir: Path) -> Optional[int]:
    """The step of the checkpoint ``latest`` names when it is there, else None (never raises)."""
    try:
        ck = latest_checkpoint(ckpt_dir)
    except (CheckpointError, OSError):
        return None
    return checkpoint_step(ck) if ck is not None else None


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
    """Create the empty temporary directory of step ``step``'s checkpoint (rank 0 only); every writer
    fills it, then rank 0 calls :func:`commit_checkpoint`."""
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
            with open(path, "wb") as f:  # through a file object a full disk is an OSError(ENOSPC)
                torch.save(content, f)
        else:
            raise CheckpointError(f"unsupported checkpoint file type {fname}")
        _fsync_file(path)


def _tensor_bytes(obj: Any) -> tuple[int, int]:
    """(bytes of every tensor in ``obj``, number of tensors), through dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size(), 1
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        parts = [_tensor_bytes(v) for v in obj]
        return sum(b for b, _ in parts), sum(n for _, n in parts)
    return 0, 0


def estimate_bytes(files: Mapping[str, Any]) -> int:
    """The disk space a checkpoint of ``files`` takes, a little generously (tensor bytes, headers, a block per file)."""
    total = 16 * 1024  # state.json, latest
    for content in files.values():
        b, n = _tensor_bytes(content)
        total += b + 256 * n + 8192  # headers / pickle records; the last block of the file
    return total


def file_checksums(directory: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size": bytes, "sha256": hex}}`` of every file under ``directory``."""
    files = sorted(p for p in Path(directory).rglob("*") if p.is_file() and p.name != STATE_JSON)
    return {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in files}


def make_room(ckpt_dir: Path, needed: int, keep: int, what: str, protect: Optional[str] = None) -> None:
    """Make sure ``needed`` bytes are free in ``ckpt_dir``, removing first stale temporary directories,
    then the oldest checkpoints ``keep`` would remove anyway (never ``latest`` nor ``protect``); else
    :class:`DiskFullError`, before anything is written."""
    ckpt_dir = Path(ckpt_dir)
    free = free_bytes(ckpt_dir)
    if free is None or free >= needed:
        return
    for stale in ckpt_dir.glob(".tmp-*"):  # partial writes of killed processes (we hold the run's lock)
        shutil.rmtree(stale, ignore_errors=True)
    good = None
    with contextlib.suppress(CheckpointError, OSError):
        good = latest_checkpoint(ckpt_dir)
    old = list_checkpoints(ckpt_dir)
    doomed = (old[: len(old) - (keep - 1)] if keep > 1 else old) if keep > 0 else []
    for ck in doomed:
        free = free_bytes(ckpt_dir) or 0
        if free >= needed:
            return
        if (good is not None and ck.resolve() == good.resolve()) or ck.name == protect:
            continue
        shutil.rmtree(ck, ignore_errors=True)
    free = free_bytes(ckpt_dir)
    if free is not None and free < needed:
        raise DiskFullError(ckpt_dir, needed, free, what=what)


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*"), reverse=True):  # files first, then their directories
        if p.is_file():
            _fsync_file(p)
        else:
            _fsync_dir(p)


def commit_checkpoint(ckpt_dir: Path, tmp: Path, step: int, keep: int = 2, run_id: Optional[str] = None) -> Path:
    """Publish a complete temporary checkpoint directory: ``state.json`` (sizes, SHA-256 sums, ``run_id``),
    fsync, rename to ``step_X``, then move ``latest``; older checkpoints beyond ``keep`` are removed."""
    ckpt_dir = Path(ckpt_dir)
    info = {"step": step, "time": time.time(), "run_id": run_id, "files": file_checksums(tmp)}
    (tmp / STATE_JSON).write_text(json.dumps(info, indent=1), encoding="utf-8")
    _fsync_tree(tmp)
    _fsync_dir(tmp)
    name = f"step_{step:08d}"
    final = ckpt_dir / name
    if final.exists():  # a re-run of the same step after a crash between rename and pointer
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_dir)
    atomic_write(ckpt_dir / LATEST, name)
    for old in list_checkpoints(ckpt_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in ckpt_dir.glob(".tmp-*"):  # partial writes of killed processes
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    for stale in ckpt_dir.glob(f".{LATEST}.tmp-*"):  # a pointer write killed before its rename
        stale.unlink(missing_ok=True)
    return final


def write_checkpoint(
    ckpt_dir: Path,
    step: int,
    files: Mapping[str, Any],
    keep: int = 2,
    run_id: Optional[str] = None,
    protect: Optional[str] = None,
) -> Path:
    """Write one checkpoint atomically (one writer: :func:`begin_checkpoint` + files + commit).

    Args:
        files: name -> content; ``*.safetensors`` take a dict of tensors, ``state.pt`` any
            weights-only-loadable object.
        keep: how many complete checkpoints to keep (0: all).
        run_id: the run's id, recorded so that a checkpoint copied from another run is recognised.
        protect: name of a checkpoint :func:`make_room` must not remove (the run's last good one).

    Raises:
        DiskFullError: the disk cannot hold it; the temporary directory is removed."""
    ckpt_dir = Path(ckpt_dir)
    needed = estimate_bytes(files)
    what = f"the checkpoint of step {step}"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    make_room(ckpt_dir, needed, keep, what, protect)
    tmp = ckpt_dir / f".tmp-step_{step:08d}-{os.getpid()}"
    with removed_on_failure(tmp, ckpt_dir, what, needed):
        tmp = begin_checkpoint(ckpt_dir, step)
        write_files(tmp, files)
        return commit_checkpoint(ckpt_dir, tmp, step, keep=keep, run_id=run_id)


def _check_safetensors_structure(path: Path) -> Optional[str]:
    """Why ``path`` is not a complete safetensors file (header and data length), or None."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name} is truncated ({size} bytes)"
            n = int.from_bytes(head, "little")
            if n > size - 8:
                return f"{path.name} is truncated ({size} bytes, its header alone needs {n + 8})"
            header = json.loads(f.read(n))
        end = max([v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"] or [0])
        if 8 + n + end != size:
            return f"{path.name} has {size} bytes, its header describes {8 + n + end}"
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"{path.name} is not a valid safetensors file ({type(e).__name__})"
    return None


def verify_checkpoint(path: Path, run_id: Optional[str] = None) -> tuple[Optional[str], bool]:
    """Check a checkpoint directory without loading it into a model.

    Returns ``(problem, checksummed)``: ``problem`` is None when it is intact, else why not;
    ``checksummed`` is False for checkpoints without recorded sums (then each file's structure is
    checked and ``state.pt`` loaded)."""
    path = Path(path)
    if not path.is_dir():
        return "it is missing", False
    if not (path / "state.pt").is_file():
        return "it has no state.pt (incomplete)", False
    try:
        info = json.loads((path / STATE_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        info = {}
    files = info.get("files") if isinstance(info, dict) else None
    if isinstance(files, dict) and files:
        other = info.get("run_id")
        if run_id and other and other != run_id:
            return f"it was written by another run (run id {other}, this run is {run_id})", True
        for rel, want in sorted(files.items()):
            p = path / rel
            if not p.is_file():
                return f"{rel} is missing", True
            size = p.stat().st_size
            why = (
                f"{rel} has {size} bytes, {want.get('size')} were written"
                if size != want.get("size")
                else f"{rel} does not match the checksum written with it (damaged)"
                if sha256_file(p) != want.get("sha256")
                else None
            )
            if why is not None:
                return _refused_code(p) or why, True
        return None, True
    for p in sorted(path.glob("*.safetensors")):
        why = _check_safetensors_structure(p)
        if why:
            return why, False
    try:
        safe_torch_load(path / "state.pt")
    except CheckpointError:
        return "state.pt does not load (truncated or damaged)", False
    return None, False


def _refused_code(path: Path) -> Optional[str]:
    """For a changed ``*.pt`` file: the safe loader's refusal when it holds code, else None."""
    if path.suffix != ".pt":
        return None
    try:
        safe_torch_load(path)
    except CheckpointError as e:
        return str(e) if "could run code" in str(e) else None
    return None


def sha256_file(path: Path) -> str:
    """The SHA-256 of one file (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def resumable_checkpoint(
    ckpt_dir: Path, run_id: Optional[str] = None, skip: Collection[Path] = ()
) -> tuple[Optional[Path], list[str]]:
    """The newest intact checkpoint of ``ckpt_dir`` (or None) and one note per checkpoint skipped or unverified.

    Every ``step_*`` directory is a candidate, newest first; those in ``skip`` are passed over without a
    note. Nothing is deleted. ``(None, [])`` means there is no checkpoint at all."""
    ckpt_dir = Path(ckpt_dir)
    notes: list[str] = []
    pointer = ckpt_dir / LATEST
    if pointer.is_file():
        with contextlib.suppress(OSError, UnicodeDecodeError):
            name = pointer.read_text(encoding="utf-8").strip()
            if not (ckpt_dir / name).is_dir():
                notes.append(f"{pointer} names {name!r}, which is missing")
    for ck in sorted(list_checkpoints(ckpt_dir), key=lambda p: checkpoint_step(p) or -1, reverse=True):
        if ck in skip:
            continue
        why, checksummed = verify_checkpoint(ck, run_id)
        if why is None:
            if not checksummed:
                notes.append(
                    f"{ck.name} has no checksums (written by an older lapheads): only its file structure was verified"
                )
            return ck, notes
        notes.append(f"skipped {ck.name}: {why}")
    return None, notes
