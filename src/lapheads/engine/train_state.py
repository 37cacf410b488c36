"""What a checkpoint of a training run holds, and how the trainer saves, restores and exports it.
Design notes: docs/design/engine.md (Checkpoints)."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError, ConfigError, DiskFullError, NonFiniteError
from . import dist as D
from . import fsdp as F
from .checkpoint import (
    begin_checkpoint,
    commit_checkpoint,
    estimate_bytes,
    latest_checkpoint,
    list_checkpoints,
    load_tensors,
    load_weights,
    make_room,
    removed_on_failure,
    resumable_checkpoint,
    safe_torch_load,
    save_tensors,
    write_checkpoint,
    write_files,
)

if TYPE_CHECKING:
    from .run import RunDir
    from .train_task import TrainTask


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global random streams."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random streams as tensors and plain values (loadable with ``weights_only``)."""
    np_state: Any = np.random.get_state()
    py_state = random.getstate()
    st = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_meta": [int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": torch.tensor(py_state[1], dtype=torch.int64),
        "python_gauss": [py_state[0], py_state[2] if py_state[2] is not None else "none"],
    }
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def set_rng_state(st: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(st["torch"])
    meta = st["numpy_meta"]
    np.random.set_state(("MT19937", st["numpy_keys"].numpy().astype(np.uint32), meta[0], meta[1], meta[2]))
    gauss = st["python_gauss"]
    random.setstate((gauss[0], tuple(int(x) for x in st["python"].tolist()), None if gauss[1] == "none" else gauss[1]))
    if device.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"], device)


class Checkpointer:
    """Saves, restores and exports the state of a training run: its model, EMA (``timm.utils.ModelEmaV3``),
    optimizers and the task's extra state. The :class:`~lapheads.engine.trainer.Trainer` builds it with
    what it set up (the trainer is above this module, so it hands the parts over rather than itself)."""

    def __init__(
        self,
        *,
        task: TrainTask,
        run: RunDir,
        info: D.DistInfo,
        model: nn.Module,
        optims: list[torch.optim.Optimizer],
        ema: Any,
        keep: int,
        seed: int,
        fsdp: bool,
        sharded: bool,
        export_skeleton: Optional[nn.Module],
    ):
        self.task, self.run, self.info, self.device = task, run, info, info.device
        self.model, self.optims, self.ema = model, list(optims), ema
        self.keep, self.seed = keep, seed  # the seed re-seeds a run resumed on another world size
        self.fsdp, self.sharded = fsdp, sharded  # DCP checkpoints; FSDP2 shards
        self.export_skeleton = export_skeleton  # under FSDP on rank 0: a parameter-free copy for final/
        self.last_step: Optional[int] = None  # step of the newest checkpoint written or loaded

    def _gather_rngs(self) -> list[Any]:
        rng = rng_state(self.device)
        if not self.info.distributed:
            return [rng]
        gathered: list[Any] = [None] * self.info.world_size
        dist.all_gather_object(gathered, rng)
        return gathered

    def _tensor_files(self) -> dict[str, Any]:
        files: dict[str, Any] = {"model.safetensors": self.model.state_dict()}
        if self.ema is not None:
            files["ema.safetensors"] = self.ema.module.state_dict()
        extra = self.task.extra_state()
        if extra:
            files["extra.safetensors"] = extra
        return files

    def _refuse_nonfinite(self, step: int, name: Optional[str]) -> None:
        ck = latest_checkpoint(self.run.ckpt_dir) if self.info.is_main else None
        raise NonFiniteError(
            f"non-finite value at step {step}: weight {name} is NaN/Inf after the optimizer "
            f"step; the checkpoint was not written (last good checkpoint: {ck if ck else 'none'})"
        )

    def save(self, step: int, skipped: int) -> None:
        """Write the checkpoint of ``step`` (every rank calls this)."""
        if self.fsdp:
            self._save_sharded(step, skipped)
            return
        optimizers = [o.state_dict() for o in self.optims]
        state = {"step": step, "skipped": skipped, "optimizers": optimizers, "rng": self._gather_rngs()}
        files = {**self._tensor_files(), "state.pt": state}
        bad = self._local_nonfinite()  # the weights are the same on every rank
        if bad is not None:
            self._refuse_nonfinite(step, bad)
        if self.info.is_main:
            write_checkpoint(
                self.run.ckpt_dir,
                step,
                files,
                keep=self.keep,
                run_id=self.run.run_id(),
                protect=None if self.last_step is None else f"step_{self.last_step:08d}",
            )
        self.last_step = step
        D.barrier()

    def _local_nonfinite(self) -> Optional[str]:
        """Name of the first weight with a NaN/Inf in this rank's shard of the model, else None."""
        for name, t in self.model.state_dict().items():
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.is_floating_point() and not bool(torch.isfinite(local).all()):
                return name
        return None

    def _save_sharded(self, step: int, skipped: int) -> None:
        """DCP shards from every rank into rank 0's temporary directory, published after a barrier."""
        bad = self._local_nonfinite()
        if D.all_max(bad is not None, self.device):  # every rank stops, none writes
            self._refuse_nonfinite(step, bad or "(on another rank)")
        rngs = self._gather_rngs()
        extra = self.task.extra_state()
        tmp = Path(D.agree(self.info, begin_checkpoint(self.run.ckpt_dir, step) if self.info.is_main else None))
        F.save_sharded(tmp, self.model, self.optims)  # collective; each rank fsyncs its own files
        D.barrier()
        if self.info.is_main:
            files: dict[str, Any] = {
                "state.pt": {"step": step, "skipped": skipped, "rng": rngs, "world_size": self.info.world_size}
            }
            if extra:
                files["extra.safetensors"] = extra
            with removed_on_failure(tmp, self.run.ckpt_dir, f"the checkpoint of step {step}"):
                write_files(tmp, files)
                commit_checkpoint(self.run.ckpt_dir, tmp, step, keep=self.keep, run_id=self.run.run_id())
        self.last_step = step
        D.barrier()

    def check_space(self) -> None:
        """Before the first checkpoint: refuse early (the same :class:`DiskFullError` on every rank) when
        the disk cannot hold one (weights + optimizer state)."""
        err: Optional[BaseException] = None
        if self.info.is_main and not list_checkpoints(self.run.ckpt_dir):
            files = {**self._tensor_files(), "state.pt": [o.state_dict() for o in self.optims]}
            needed = estimate_bytes(files)
            if self.sharded:  # the shards of the other ranks land in the same directory
                needed *= self.info.world_size
            try:
                make_room(self.run.ckpt_dir, needed, self.keep, "a checkpoint of this run (weights + optimizer state)")
            except DiskFullError as e:
                err = e
        D.agree(self.info, err)

    def load(self, path: Path) -> tuple[int, int]:
        """Load the checkpoint ``path``; returns its ``(step, skipped steps)``."""
        sharded = F.is_sharded_checkpoint(path)
        if self.fsdp and not sharded:
            raise ConfigError(
                f"{path} is a single-file checkpoint (train.parallel=ddp); resume it with train.parallel=ddp"
            )
        if sharded:
            F.load_sharded(path, self.model, self.optims)
        else:
            load_weights(self.model, load_tensors(path / "model.safetensors"), source=str(path / "model.safetensors"))
            if self.ema is not None:
                ema_file = path / "ema.safetensors"
                load_weights(self.ema.module, load_tensors(ema_file), source=str(ema_file))
        if (path / "extra.safetensors").is_file():
            self.task.load_extra_state(load_tensors(path / "extra.safetensors"))
        st = safe_torch_load(path / "state.pt")
        if not sharded:
            if len(st["optimizers"]) != len(self.optims):
                raise ConfigError(
                    f"{path} holds {len(st['optimizers'])} optimizer states, the recipe builds {len(self.optims)}"
                )
            for opt, sd in zip(self.optims, st["optimizers"]):
                opt.load_state_dict(sd)
        step, skipped, rngs = int(st["step"]), int(st.get("skipped", 0)), st["rng"]
        if len(rngs) == self.info.world_size:
            set_rng_state(rngs[self.info.rank], self.device)
        elif not sharded:
            raise ConfigError(
                f"{path} was written by {len(rngs)} processes but this run has {self.info.world_size}; "
                f"exact resume needs the same world size: resume it on {len(rngs)} processes (torchrun); "
                "checkpoints of train.parallel=fsdp also resume on another number"
            )
        else:  # re-sharded: weights and optimizer states are exact, random streams and data order cannot be
            seed_everything(self.seed + self.info.rank + 1_000_003 * step)
            if self.info.is_main:
                print(
                    f"{path} was written by {len(rngs)} processes, this run has {self.info.world_size}: weights "
                    "and optimizer states were re-sharded; data order and random streams differ from an "
                    "uninterrupted run",
                    file=sys.stderr,
                    flush=True,
                )
        self.last_step = step
        return step, skipped

    def restore(self) -> tuple[int, int]:
        """Load the newest intact checkpoint (verified first; one that does not load is skipped too, and
        each skip named on stderr); returns its ``(step, skipped steps)``, ``(0, 0)`` when there is none.

        Raises:
            CheckpointError: checkpoints exist but none is intact (nothing is deleted)."""
        notes: list[str] = []
        run_id = self.run.run_id()
        tried: set[Path] = set()
        while True:
            ck, found = resumable_checkpoint(self.run.ckpt_dir, run_id, skip=tried)
            notes += [n for n in found if n not in notes]
            if ck is None:
                break
            try:
                step, skipped = self.load(ck)
            except CheckpointError as e:  # a damaged file the checksum could not see, another architecture
                tried.add(ck)
                notes.append(f"skipped {ck.name}: {' '.join(str(e).split())[:300]}")
                continue
            if self.info.is_main:
                kept = "; nothing was deleted" if any(n.startswith("skipped ") for n in notes) else ""
                print(
                    f"--resume: {''.join(n + '; ' for n in notes)}resuming {self.run.path} from step {step} "
                    f"({ck.name}){kept}",
                    file=sys.stderr,
                    flush=True,
                )
            return step, skipped
        if not notes and self.info.is_main:
            print(f"--resume: {self.run.path} has no checkpoint yet; starting at step 0", file=sys.stderr, flush=True)
        if notes:  # checkpoints were written (skipped ones, or a latest that names a missing step)
            raise CheckpointError(
                f"--resume: no intact checkpoint in {self.run.ckpt_dir}: {'; '.join(notes)}; "
                f"nothing was deleted; restore a checkpoint from a copy, or start afresh "
                f"with --overwrite"
            )
        return 0, 0

    def export_final(self, step: int, metrics: dict[str, Any]) -> None:
        """Write ``final/`` (every rank calls this; rank 0 writes): weights, EMA weights, ``model.json``,
        ``metrics.json`` and the task's files."""
        full = F.full_state_dict(self.model) if self.sharded else None  # collective: every rank takes part
        if self.info.is_main:
            model = self.model if full is None else F.materialize(cast(nn.Module, self.export_skeleton), full)
            ema = self.ema.module if self.ema is not None else None
            final = self.run.final_dir
            tmp = final.with_name(".final.tmp")
            if tmp.exists():
                shutil.rmtree(tmp)
            tensors = {"model.safetensors": model.state_dict()}
            if ema is not None:
                tensors["ema.safetensors"] = ema.state_dict()
            with removed_on_failure(tmp, self.run.path, "final/ (the exported model)", estimate_bytes(tensors)):
                tmp.mkdir(parents=True)
                for name, sd in tensors.items():
                    save_tensors(tmp / name, sd)
                spec = {"recipe": self.task.name, "step": step, **self.task.model_spec()}
                (tmp / "model.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
                (tmp / "metrics.json").write_text(json.dumps(metrics, indent=1), encoding="utf-8")
                self.task.export_final(tmp, model, ema)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
        D.barrier()
