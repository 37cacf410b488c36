"""Experiment trackers: TensorBoard, Weights & Biases and MLflow behind one small interface.

``train.trackers: [tensorboard, wandb, mlflow]`` (any subset, in any order; ``metrics.jsonl`` is
always written, by the trainer, whatever is chosen) picks them; the default ``[tensorboard]`` is
the engine's behaviour before trackers existed. Every tracker is a :class:`Tracker`:

``start(resume_step)``
    open (or, on ``--resume``, reopen) the tracker's run and log the run's resolved config;
``log(record)``
    one record of ``metrics.jsonl`` (already plain JSON values): its numbers as scalars under
    ``<split>/<key>`` (split ``train`` for records without one) at ``record["step"]``, and the
    learnable head-mixing table ``lap_mix`` of an evaluation as a table;
``log_artifact(path, name)``
    a file (the final metrics, the figures of the run's final report);
``finish(status)``
    close the run: ``"finished"``, ``"failed"`` or ``"interrupted"`` (MLflow marks it
    ``FINISHED``, ``FAILED`` or ``KILLED``; a W&B run exits with 0 or 1).

At the end of a run that finished, the trackers that take files get ``final/metrics.json``,
``final/model.json`` and the files a higher layer registered (:func:`log_final`,
:func:`add_final_files`): ``lapheads train`` registers the figures of the run's own report (the
loss and validation curves, and the learned head mixing of a ``laplacian_heads: learn...`` run).

Design choices:

* Rank 0 only: the trainer builds trackers on the main process (:func:`build_trackers`), so a
  DDP job is one tracker run, not one per rank.
* A resumed run continues the SAME tracker run: the W&B run id and the MLflow run id are stored
  in ``RUN_DIR/trackers.json`` when the run starts, and a resume reopens them (W&B
  ``resume="allow"`` with that id, MLflow ``start_run(run_id=...)``). W&B and MLflow cannot delete
  points, so what a killed attempt logged after its last checkpoint stays there (``metrics.jsonl``
  and TensorBoard are trimmed to the checkpoint, see :mod:`lapheads.engine.trainer`); the
  resumed attempt logs those steps again, so the newest value at a step is the one of the run
  that went on. W&B's own step counter must grow, so every metric is plotted against the logged
  ``step`` (``define_metric(..., step_metric="step")``), never against W&B's counter.
* Where the runs go is each tool's own configuration: ``WANDB_MODE`` (``offline`` writes
  ``wandb/offline-run-*`` under ``train.tracker_dir`` or the run directory, synced later with
  ``wandb sync``), ``WANDB_ENTITY`` and W&B's login; ``train.mlflow_tracking_uri`` or else
  ``MLFLOW_TRACKING_URI`` and MLflow's default. ``train.tracker_project`` names the W&B project
  and the MLflow experiment, ``train.tracker_run_name`` the run (default: the run directory's
  name).
* The packages are optional: a tracker whose package is missing is one
  :class:`~lapheads.errors.ConfigError` line when the trainer is built, naming the package and
  the extra that installs it (``pip install 'lapheads[trackers]'``), before anything is trained.
* A tracker that fails while logging (a network hiccup, a full disk) does not stop training:
  the first failure of each tracker is printed as one line on stderr and the tracker is dropped
  for the rest of the attempt. ``metrics.jsonl`` stays the record of truth.
"""

from __future__ import annotations

import importlib.util
import math
import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from ..errors import ConfigError, LapheadsError
from ..outputs import read_json, write_json

__all__ = [
    "TRACKERS",
    "Tracker",
    "TensorBoardTracker",
    "WandbTracker",
    "MlflowTracker",
    "build_trackers",
    "check_trackers",
    "TrackerGroup",
    "STATE_FILE",
    "log_final",
]

#: tracker name -> (python module it needs, pip package, extra that installs it)
TRACKERS: dict[str, tuple[str, str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard", "train"),
    "wandb": ("wandb", "wandb", "trackers"),
    "mlflow": ("mlflow", "mlflow-skinny", "trackers"),  # the client; the full `mlflow` (server, UI) works too
}
#: file in the run directory that keeps each tracker's run id (what a resume reopens)
STATE_FILE = "trackers.json"


def check_trackers(names: Sequence[str]) -> None:
    """Raise one ConfigError line when the package of a chosen tracker is not installed.

    Raises:
        ConfigError: ``train.trackers`` names a tracker whose package is missing (the message names
            the package and the extra), or an unknown one.
    """
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"train.trackers: unknown tracker {name!r}; expected some of {sorted(TRACKERS)}")
        module, package, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"train.trackers includes {name!r} but its package is not installed (no module named "
                f"{module!r}); install it with pip install {package} (or pip install "
                f"'lapheads[{extra}]')"
            )


def _scalars(record: dict[str, Any]) -> tuple[str, int, dict[str, float]]:
    """``(prefix, step, {key: value})``: the finite numbers of a record, as TensorBoard logs them."""
    prefix = str(record.get("split", "train"))
    step = int(record.get("step", 0))
    out = {}
    for k, v in record.items():
        if k == "step" or not isinstance(v, (int, float)):  # bools log as 0 / 1, as TensorBoard always did
            continue
        if math.isfinite(v):
            out[f"{prefix}/{k}"] = float(v)
    return prefix, step, out


def mixing_rows(table: Any) -> list[list[Any]]:
    """The rows ``[layer, head, a, b, laplacianness]`` of a ``lap_mix`` table (:func:`lapheads.heads.mixing_table`)."""
    rows = []
    for row in table if isinstance(table, list) else []:
        if not isinstance(row, dict):
            continue
        lap = row.get("laplacianness") or [None] * len(row.get("a", []))
        for h, (a, b, ln) in enumerate(zip(row.get("a", []), row.get("b", []), lap)):
            rows.append([str(row.get("layer", "")), h, float(a), float(b), None if ln is None else float(ln)])
    return rows


MIXING_COLUMNS = ["layer", "head", "a", "b", "laplacianness"]


class Tracker:
    """One experiment tracker (see the module docstring for the four calls)."""

    name = "tracker"

    def __init__(self, run_dir: Path, options: dict[str, Any], config: dict[str, Any], state: dict[str, Any]):
        self.run_dir = Path(run_dir)
        self.options = options  # project, run_name, dir, mlflow_tracking_uri
        self.config = config  # the run's resolved config (config.yaml), nested
        self.state = state  # this tracker's entry of trackers.json (read, and filled by start())

    def start(self, resume_step: Optional[int]) -> None:
        """Open the tracker's run; ``resume_step``: the checkpoint's step on a resume, else None."""

    def log(self, record: dict[str, Any]) -> None:
        """Log one ``metrics.jsonl`` record."""

    def log_artifact(self, path: Path, name: Optional[str] = None) -> None:
        """Log a file (``name``: its path inside the tracker's run; default the file name)."""

    takes_files = True  # log_final draws the run's report figures only when some tracker takes files

    def finish(self, status: str = "finished") -> None:
        """Close the run (``status``: finished, failed or interrupted)."""


class TensorBoardTracker(Tracker):
    """``RUN_DIR/tb`` event files; after a resume the events past the checkpoint are purged."""

    name = "tensorboard"
    takes_files = False

    def start(self, resume_step: Optional[int]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        tb_dir = self.run_dir / "tb"
        purge = None if resume_step is None else resume_step + 1
        if purge is not None:
            from .trainer import _after_earlier_event_files

            _after_earlier_event_files(tb_dir)
        self.writer = SummaryWriter(str(tb_dir), purge_step=purge)

    def log(self, record: dict[str, Any]) -> None:
        _, step, values = _scalars(record)
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def finish(self, status: str = "finished") -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run (``WANDB_MODE=offline`` works without an account)."""

    name = "wandb"

    def start(self, resume_step: Optional[int]) -> None:
        import wandb

        run_id = self.state.get("run_id") or secrets.token_hex(6)
        where = Path(self.options.get("dir") or self.run_dir)
        where.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.options["project"],
            name=self.options["run_name"],
            id=run_id,
            resume="allow",
            dir=str(where),
            config=self.config,
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.state.update(run_id=self.run.id, project=self.options["project"])

    def log(self, record: dict[str, Any]) -> None:
        import wandb

        prefix, step, values = _scalars(record)
        payload: dict[str, Any] = {"step": step, **values}
        rows = mixing_rows(record.get("lap_mix"))
        if rows:
            payload[f"{prefix}/lap_mix"] = wandb.Table(columns=list[Any](MIXING_COLUMNS), data=rows)
        self.run.log(payload)

    def log_artifact(self, path: Path, name: Optional[str] = None) -> None:
        path = Path(path)
        if path.suffix.lower() in (".png", ".jpg", ".jpeg"):
            import wandb

            self.run.log({f"report/{Path(name or path.name).stem}": wandb.Image(str(path))})
        # a copy inside the run's files/ (wandb.save links to its argument, and a report's figures are
        # drawn into a temporary directory)
        dest = Path(self.run.dir) / (name or path.name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
        self.run.save(str(dest), base_path=str(self.run.dir), policy="now")

    def finish(self, status: str = "finished") -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)


class MlflowTracker(Tracker):
    """An MLflow run: params = the flattened config, metrics by step, ``lap_mix`` as JSON artifacts."""

    name = "mlflow"

    def start(self, resume_step: Optional[int]) -> None:
        from mlflow.tracking import MlflowClient

        from .run import flatten_config

        uri = self.options.get("mlflow_tracking_uri") or None
        self.client = MlflowClient(tracking_uri=uri)
        run_id = self.state.get("run_id")
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
        else:
            project = self.options["project"]
            exp = self.client.get_experiment_by_name(project)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
            run = self.client.create_run(
                exp_id, run_name=self.options["run_name"], tags={"lapheads.run_dir": str(self.run_dir.resolve())}
            )
            run_id = run.info.run_id
            from mlflow.entities import Param

            params = [Param(k, str(v)[:6000]) for k, v in flatten_config(self.config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(run_id, params=params[i : i + 100])
            self.client.log_dict(run_id, self.config, "config.json")
        self.run_id = run_id
        self.state.update(run_id=run_id, tracking_uri=self.client.tracking_uri)

    def log(self, record: dict[str, Any]) -> None:
        import time

        from mlflow.entities import Metric

        prefix, step, values = _scalars(record)
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        if isinstance(record.get("lap_mix"), list) and record["lap_mix"]:
            self.client.log_dict(
                self.run_id,
                {"step": step, "columns": MIXING_COLUMNS, "rows": mixing_rows(record["lap_mix"])},
                f"lap_mix/{prefix}_step_{step:08d}.json",
            )

    def log_artifact(self, path: Path, name: Optional[str] = None) -> None:
        sub = str(Path(name).parent) if name and str(Path(name).parent) != "." else None
        self.client.log_artifact(self.run_id, str(path), artifact_path=sub)

    def finish(self, status: str = "finished") -> None:
        self.client.set_terminated(
            self.run_id, status={"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
        )


_CLASSES: dict[str, type[Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


def _read_state(run_dir: Path) -> dict[str, Any]:
    try:
        data = read_json(Path(run_dir) / STATE_FILE, missing={})
    except LapheadsError:  # a damaged record: the trackers start new runs
        return {}
    return data if isinstance(data, dict) else {}


def _read_config(run_dir: Path) -> dict[str, Any]:
    p = Path(run_dir) / "config.yaml"
    if not p.is_file():
        return {}
    from .config import load_yaml

    data = load_yaml(p.read_text(encoding="utf-8"), str(p))
    return data if isinstance(data, dict) else {}


class TrackerGroup:
    """The trackers of one attempt: every call goes to each of them; a failing one is dropped with a
    line on stderr (module docstring)."""

    def __init__(self, trackers: Iterable[Tracker], run_dir: Path, state: dict[str, Any]):
        self.trackers = list(trackers)
        self.run_dir = Path(run_dir)
        self.state = state

    def _each(self, what: str, *args: Any) -> None:
        for t in list(self.trackers):
            try:
                getattr(t, what)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker never stops training (module docstring)
                print(
                    f"lapheads: warning: tracker {t.name} failed in {what} ({type(e).__name__}: {e}); "
                    "it logs nothing more in this attempt (metrics.jsonl is complete)",
                    file=sys.stderr,
                    flush=True,
                )
                self.trackers.remove(t)
                if what != "finish":
                    try:
                        t.finish("failed")
                    except Exception:  # noqa: BLE001
                        pass

    def start(self, resume_step: Optional[int]) -> None:
        self._each("start", resume_step)
        ids = {k: v for k, v in self.state.items() if v}
        if ids:
            write_json(self.run_dir / STATE_FILE, ids)

    def log(self, record: dict[str, Any]) -> None:
        self._each("log", record)

    def log_artifact(self, path: Path, name: Optional[str] = None) -> None:
        self._each("log_artifact", path, name)

    def finish(self, status: str = "finished") -> None:
        self._each("finish", status)
        self.trackers = []


def build_trackers(names: Sequence[str], run_dir: Path, options: dict[str, Any]) -> TrackerGroup:
    """The :class:`TrackerGroup` of ``names`` for ``run_dir`` (not started; :meth:`TrackerGroup.start`).

    Args:
        names: ``train.trackers``.
        run_dir: the run directory (its ``config.yaml`` is the logged config, its ``trackers.json``
            the run ids a resume continues).
        options: ``project``, ``run_name`` (empty: the run directory's name), ``dir`` (W&B's
            files; empty: the run directory) and ``mlflow_tracking_uri``.
    """
    check_trackers([n for n in names if n != "tensorboard"])
    if "tensorboard" in names and importlib.util.find_spec("tensorboard") is None:
        names = [n for n in names if n != "tensorboard"]  # a dependency of lapheads[train]; tolerated missing
    run_dir = Path(run_dir)
    opts = {**options, "run_name": options.get("run_name") or run_dir.resolve().name}
    state = _read_state(run_dir)
    config = _read_config(run_dir)
    trackers = []
    for name in dict.fromkeys(names):
        entry = state.setdefault(name, {}) if name != "tensorboard" else {}
        trackers.append(_CLASSES[name](run_dir, opts, config, entry))
    return TrackerGroup(trackers, run_dir, state)


#: Makers of the files a finished run adds to its trackers besides ``final/``: each is
#: ``maker(run_dir, tmp_dir) -> [(file, name)]`` and draws into ``tmp_dir``. The engine knows no
#: report; the layer that does registers one (``lapheads train`` registers the run's own report
#: figures, :func:`lapheads.report.run_figures`).
FINAL_FILE_MAKERS: list[Callable[[Path, Path], list[tuple[Path, str]]]] = []


def add_final_files(maker: Callable[[Path, Path], list[tuple[Path, str]]]) -> None:
    """Register ``maker`` in :data:`FINAL_FILE_MAKERS` (once; registering it again changes nothing)."""
    if maker not in FINAL_FILE_MAKERS:
        FINAL_FILE_MAKERS.append(maker)


def log_final(group: TrackerGroup, run_dir: Path) -> None:
    """Log ``final/metrics.json``, ``final/model.json`` and the files of every registered maker
    (:data:`FINAL_FILE_MAKERS`, drawn into a temporary directory, so the run directory is unchanged)
    to the trackers that take files. A maker that fails is one warning line: training has finished."""
    if not any(t.takes_files for t in group.trackers):
        return
    run_dir = Path(run_dir)
    for name in ("metrics.json", "model.json"):
        if (run_dir / "final" / name).is_file():
            group.log_artifact(run_dir / "final" / name, f"final/{name}")
    for maker in FINAL_FILE_MAKERS:
        with tempfile.TemporaryDirectory(prefix="lapheads-tracker-files-") as tmp:
            try:
                files = maker(run_dir, Path(tmp))
            except Exception as e:  # noqa: BLE001 - the figures are a convenience; training has finished
                print(
                    f"lapheads: warning: files for the trackers were not made ({type(e).__name__}: {e})",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            for path, name in files:
                group.log_artifact(path, name)
