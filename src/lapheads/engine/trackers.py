"""Experiment trackers: TensorBoard, Weights & Biases and MLflow behind one small interface.
Design notes: docs/design/engine.md (Trackers)."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence
from urllib.parse import urlparse

from ..errors import ConfigError, LapheadsError
from ..outputs import check_out_dir, read_json, write_json
from .config import flatten_config, load_yaml

#: tracker name -> (python module it needs, pip package, extra that installs it)
TRACKERS: dict[str, tuple[str, str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard", "train"),
    "wandb": ("wandb", "wandb", "trackers"),
    "mlflow": ("mlflow", "mlflow-skinny", "trackers"),  # the client; the full `mlflow` (server, UI) works too
}
#: file in the run directory that keeps each tracker's run id (what a resume reopens)
STATE_FILE = "trackers.json"
#: the SQLAlchemy dialects of MLflow's database stores (``sqlite:///...``, ``postgresql://...``)
_MLFLOW_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")
#: W&B settings that lapheads sets only when the user has not: each with the ``WANDB_*`` variables that set it.
WANDB_DEFAULTS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "resume": ("allow", ("WANDB_RESUME",)),  # a resumed lapheads run continues its W&B run
    "console": ("off", ("WANDB_CONSOLE",)),  # the run's stdout stays the user's
    "silent": (True, ("WANDB_SILENT",)),
    "x_disable_stats": (True, ("WANDB_X_DISABLE_STATS", "WANDB__DISABLE_STATS")),  # no system metrics
}


class Table(NamedTuple):
    """A record value that the trackers log as a table (:meth:`lapheads.engine.Task.tables`)."""

    columns: list[str]
    rows: Callable[[Any], list[list[Any]]]  # the value -> its rows, each in the order of columns


def check_trackers(names: Sequence[str], *, mlflow_tracking_uri: str = "", tracker_dir: str = "") -> None:
    """Raise one ConfigError line when a tracker of ``names`` could not log: its package is missing (naming the
    package and the extra; a missing ``tensorboard`` is tolerated), MLflow cannot open its store
    (``train.mlflow_tracking_uri``), or W&B's directory (``train.tracker_dir``) cannot be written."""
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"train.trackers: unknown tracker {name!r}; expected some of {sorted(TRACKERS)}")
        module, package, extra = TRACKERS[name]
        if name != "tensorboard" and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"train.trackers includes {name!r} but its package is not installed (no module named "
                f"{module!r}); install it with pip install {package} (or pip install "
                f"'lapheads[{extra}]')"
            )
    if "mlflow" in names:
        _check_mlflow_store(mlflow_tracking_uri)
    path, key = (tracker_dir, "train.tracker_dir") if tracker_dir else (os.environ.get("WANDB_DIR"), "WANDB_DIR")
    if "wandb" in names and path:
        target = Path(path).expanduser().absolute()
        try:
            check_out_dir(target, key)
        except ConfigError as e:
            raise ConfigError(
                f"{key}={path}: W&B cannot write its files there ({str(e).removeprefix(f'{key} {target} ')}); set {key} to a writable directory "
                f"or unset it (then they go to the run directory)"
            ) from None


def _check_mlflow_store(configured: str) -> None:
    """One ConfigError line when the installed MLflow cannot open the store it would log to."""
    if configured:
        uri, source = configured, "train.mlflow_tracking_uri"
    else:
        import mlflow

        uri = mlflow.get_tracking_uri()
        source = "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "MLflow's default"
    scheme = urlparse(uri).scheme.split("+")[0].lower()
    if scheme in _MLFLOW_DATABASES:
        missing = [m for m in ("sqlalchemy", "alembic") if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(
                f"train.trackers includes 'mlflow' and its store {uri} ({source}) is a database, which "
                f"MLflow opens with SQLAlchemy and Alembic (no module named {missing[0]!r}); install them "
                "with pip install sqlalchemy alembic (or pip install 'lapheads[trackers]')"
            )
    elif scheme in ("", "file"):
        import mlflow
        import mlflow.environment_variables as mlflow_env

        opt_out = getattr(mlflow_env, "MLFLOW_ALLOW_FILE_STORE", None)  # only in the releases that refuse it
        if opt_out is not None and not opt_out.get():
            raise ConfigError(
                f"train.trackers includes 'mlflow' and its store {uri} ({source}) is MLflow's file store, "
                f"which MLflow {mlflow.__version__} refuses; set MLFLOW_ALLOW_FILE_STORE=true (MLflow's "
                "opt-out) or use a database, e.g. MLflow's default sqlite:///mlflow.db (leave "
                "train.mlflow_tracking_uri and MLFLOW_TRACKING_URI unset)"
            )


def _scalars(record: dict[str, Any]) -> tuple[str, int, dict[str, float]]:
    """``(prefix, step, {key: value})``: the finite numbers of a record, as TensorBoard logs them."""
    prefix = str(record.get("split", "train"))
    step = int(record.get("step", 0))
    # bools log as 0 / 1, as TensorBoard always did
    numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
    return prefix, step, {f"{prefix}/{k}": float(v) for k, v in numbers.items() if math.isfinite(v)}


class Tracker:
    """One experiment tracker: ``start``, ``log``, ``log_artifact`` and ``finish`` (docs/design/engine.md)."""

    name = "tracker"

    def __init__(
        self,
        run_dir: Path,
        options: dict[str, Any],
        config: dict[str, Any],
        state: dict[str, Any],
        tables: Optional[dict[str, Table]] = None,
    ):
        self.run_dir = Path(run_dir)
        self.options = options  # project, run_name, dir, mlflow_tracking_uri (empty: the tool's default)
        self.config = config  # the run's resolved config (config.yaml), nested
        self.state = state  # this tracker's entry of trackers.json (read, and filled by start())
        self.tables = tables or {}  # record key -> Table (Task.tables)

    def _tables(self, record: dict[str, Any]) -> dict[str, tuple[list[Any], list[list[Any]]]]:
        """``{key: (columns, rows)}`` of the record's non-empty values that the task declared tables."""
        return {
            key: (list(table.columns), rows)
            for key, table in self.tables.items()
            if record.get(key) and (rows := table.rows(record[key]))
        }

    def start(self, resume_step: Optional[int]) -> None:
        """Open the tracker's run; ``resume_step``: the checkpoint's step on a resume, else None."""

    def log(self, record: dict[str, Any]) -> None:
        """Log one ``metrics.jsonl`` record."""

    def log_artifact(self, path: Path, name: Optional[str] = None) -> None:
        """Log a file (``name``: its path inside the tracker's run; default the file name)."""

    takes_files = True  # log_final draws the run's report figures only when some tracker takes files

    def finish(self, status: str = "finished") -> None:
        """Close the run (``status``: finished, failed or interrupted)."""


def _after_earlier_event_files(tb_dir: Path) -> None:
    """Wait (at most a second) until a new TensorBoard event file sorts after every earlier one (design notes)."""
    names = [f.name.split(".") for f in Path(tb_dir).glob("events.out.tfevents.*")]
    stamps = [int(parts[3]) for parts in names if len(parts) > 3 and parts[3].isdigit()]
    while stamps and int(time.time()) <= max(stamps):
        time.sleep(0.05)


class TensorBoardTracker(Tracker):
    """``RUN_DIR/tb`` event files; after a resume the events past the checkpoint are purged."""

    name = "tensorboard"
    takes_files = False

    def start(self, resume_step: Optional[int]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        tb_dir = self.run_dir / "tb"
        purge = None if resume_step is None else resume_step + 1
        if purge is not None:
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

        env = os.environ
        where = Path(self.options.get("dir") or env.get("WANDB_DIR") or self.run_dir)
        where.mkdir(parents=True, exist_ok=True)
        project = self.options.get("project") or env.get("WANDB_PROJECT") or "lapheads"
        name = self.options.get("run_name") or env.get("WANDB_NAME") or self.run_dir.resolve().name
        unset = {k: v for k, (v, names) in WANDB_DEFAULTS.items() if not any(env.get(n) for n in names)}
        resume = {"resume": unset.pop("resume")} if "resume" in unset else {}
        run_id = {"id": self.state["run_id"]} if self.state.get("run_id") else {}  # else W&B's (or WANDB_RUN_ID)
        self.run = wandb.init(
            project=project,
            name=name,
            dir=str(where),
            config=self.config,
            settings=wandb.Settings(**unset),
            **resume,
            **run_id,
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.state.update(run_id=self.run.id, project=project)

    def log(self, record: dict[str, Any]) -> None:
        import wandb

        prefix, step, values = _scalars(record)
        payload: dict[str, Any] = {"step": step, **values}
        for key, (columns, rows) in self._tables(record).items():
            payload[f"{prefix}/{key}"] = wandb.Table(columns=columns, data=rows)
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
    """An MLflow run: params = the flattened config, metrics by step, tables as JSON artifacts."""

    name = "mlflow"

    def start(self, resume_step: Optional[int]) -> None:
        from mlflow.tracking import MlflowClient

        # a resume continues in the store its run started in, unless train.mlflow_tracking_uri names one
        uri = self.options.get("mlflow_tracking_uri") or self.state.get("tracking_uri") or None
        self.client = MlflowClient(tracking_uri=uri)
        run_id = self.state.get("run_id")
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
        else:
            project = self.options.get("project") or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "lapheads"
            exp = self.client.get_experiment_by_name(project)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
            run = self.client.create_run(
                exp_id,
                run_name=self.options.get("run_name") or self.run_dir.resolve().name,
                tags={"lapheads.run_dir": str(self.run_dir.resolve())},
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
        from mlflow.entities import Metric

        prefix, step, values = _scalars(record)
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        for key, (columns, rows) in self._tables(record).items():
            self.client.log_dict(
                self.run_id, {"step": step, "columns": columns, "rows": rows}, f"{key}/{prefix}_step_{step:08d}.json"
            )

    def log_artifact(self, path: Path, name: Optional[str] = None) -> None:
        sub = str(Path(name).parent) if name and str(Path(name).parent) != "." else None
        self.client.log_artifact(self.run_id, str(path), artifact_path=sub)

    def finish(self, status: str = "finished") -> None:
        self.client.set_terminated(
            self.run_id, status={"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
        )


_CLASSES: dict[str, type[Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


class TrackerGroup:
    """The trackers of one attempt: every call goes to each; a failing one is dropped with a line on stderr."""

    def __init__(self, trackers: Iterable[Tracker], run_dir: Path, state: dict[str, Any]):
        self.trackers, self.run_dir, self.state = list(trackers), Path(run_dir), state

    def _each(self, what: str, *args: Any) -> None:
        for t in list(self.trackers):
            try:
                getattr(t, what)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker never stops training
                print(
                    f"lapheads: warning: tracker {t.name} failed in {what} ({type(e).__name__}: {e}); "
                    "it logs nothing more in this attempt (metrics.jsonl is complete)",
                    file=sys.stderr,
                    flush=True,
                )
                self.trackers.remove(t)
                if what != "finish":
                    with contextlib.suppress(Exception):
                        t.finish("failed")

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


def build_trackers(
    names: Sequence[str], run_dir: Path, options: dict[str, Any], tables: Optional[dict[str, Table]] = None
) -> TrackerGroup:
    """The :class:`TrackerGroup` of ``names`` for ``run_dir`` (not started; :meth:`TrackerGroup.start`).

    ``options``: ``project``, ``run_name``, ``dir`` and ``mlflow_tracking_uri`` as in ``train.*``;
    ``tables``: the record keys logged as tables (:meth:`lapheads.engine.Task.tables`)."""
    check_trackers(
        names, mlflow_tracking_uri=options.get("mlflow_tracking_uri") or "", tracker_dir=options.get("dir") or ""
    )
    if "tensorboard" in names and importlib.util.find_spec("tensorboard") is None:
        names = [n for n in names if n != "tensorboard"]  # a dependency of lapheads[train]; tolerated missing
    run_dir = Path(run_dir)
    try:
        state = read_json(run_dir / STATE_FILE, missing={})
    except LapheadsError:  # a damaged record: the trackers start new runs
        state = {}
    state = state if isinstance(state, dict) else {}
    saved = run_dir / "config.yaml"
    config = load_yaml(saved.read_text(encoding="utf-8"), str(saved)) if saved.is_file() else {}
    config = config if isinstance(config, dict) else {}
    trackers = []
    for name in dict.fromkeys(names):
        entry = state.setdefault(name, {}) if name != "tensorboard" else {}
        trackers.append(_CLASSES[name](run_dir, options, config, entry, tables))
    return TrackerGroup(trackers, run_dir, state)


#: Makers of the files a finished run adds to its trackers besides ``final/``, registered by a higher
#: layer: ``maker(run_dir, tmp_dir) -> [(file, name)]``, drawing into ``tmp_dir``.
FINAL_FILE_MAKERS: list[Callable[[Path, Path], list[tuple[Path, str]]]] = []


def add_final_files(maker: Callable[[Path, Path], list[tuple[Path, str]]]) -> None:
    """Register ``maker`` in :data:`FINAL_FILE_MAKERS` (once; registering it again changes nothing)."""
    if maker not in FINAL_FILE_MAKERS:
        FINAL_FILE_MAKERS.append(maker)


def log_final(group: TrackerGroup, run_dir: Path) -> None:
    """Log ``final/metrics.json``, ``final/model.json`` and the files of every registered maker (drawn
    into a temporary directory) to the trackers that take files; a failing maker is one warning line."""
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
