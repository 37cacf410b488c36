"""``--launcher slurm``: ``lapheads train`` and ``lapheads sweep`` on a SLURM cluster, through submitit.
Usage: docs/slurm.md; design notes: docs/design/engine.md (SLURM)."""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import gc
import importlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from pydantic import Field

from ..errors import ConfigError, LapheadsError, RunFailed
from ..outputs import read_json, removed_on_failure, write_json
from .config import ConfigModel, Float, Int, Str, from_dict, read_yaml
from .dist import env_from_slurm
from .run import RunDir

PREEMPT_SIGNAL = "USR1"  # what the trainer turns into "checkpoint and stop" (engine.trainer)
JOBS_FILE = "jobs.json"  # in a sweep's slurm/ folder
RUN_RECORD = "slurm.json"  # in a run directory
ACTIVE = {"RUNNING", "COMPLETING", "PREEMPTED"}  # squeue states of a running job


class LauncherConfig(ConfigModel):
    """Where and how a job runs on SLURM (``--launcher-config`` YAML keys; flags override them)."""

    partition: Str = Field("", description="SLURM partition; empty = the cluster's default")
    nodes: Int = Field(1, ge=1, description="nodes per job (multi-node DDP/FSDP2)")
    gpus_per_node: Int = Field(0, ge=0, description="GPUs per node (--gpus-per-node)")
    tasks_per_node: Int = Field(0, ge=0, description="training processes per node; 0 = gpus_per_node, at least 1")
    cpus_per_task: Int = Field(1, ge=1, description="CPUs per training process (also its OMP_NUM_THREADS)")
    mem_gb: Float = Field(0.0, ge=0.0, description="memory per node in GB; 0 = the partition's default")
    time_min: Int = Field(60, ge=1, description="time limit of one attempt in minutes")
    signal_delay_s: Int = Field(120, ge=1, description="SIGUSR1 this many seconds before the time limit")
    max_requeues: Int = Field(3, ge=0, description="requeues after a time limit (preemptions are not counted)")
    array_parallelism: Int = Field(0, ge=0, description="sweep points running at once; 0 = all")
    job_name: Str = Field("", description="SLURM job name; empty = lapheads-<recipe>")
    sbatch: dict[str, Str] = Field(
        default_factory=dict, description="extra sbatch flags, e.g. {account: abc, qos: high, constraint: a100}"
    )
    setup: list[Str] = Field(
        default_factory=list, description="shell lines run before the job's srun (module load, source a venv)"
    )
    poll_s: Float = Field(2.0, gt=0.0, description="seconds between two squeue polls while waiting")

    @property
    def ntasks_per_node(self) -> int:
        return self.tasks_per_node or max(1, self.gpus_per_node)


_SBATCH_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")  # an sbatch long option's name (account, gres, ...)
_KEYS = (
    "partition nodes gpus_per_node tasks_per_node cpus_per_task mem_gb time_min max_requeues array_parallelism job_name"
)
_FLAGS = {  # flag -> (LauncherConfig key, type)
    "--" + key.replace("_", "-"): (key, {"partition": str, "mem_gb": float, "job_name": str}.get(key, int))
    for key in _KEYS.split()
}


def add_launcher_args(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    """The ``--launcher`` flags of ``lapheads train`` and ``lapheads sweep``."""
    g = p.add_argument_group("launcher (--launcher slurm: submit through submitit; docs/slurm.md)")
    g.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="local: train in this process (default); slurm: submit to SLURM "
        + ("(one array task per point)" if sweep else "(one job)"),
    )
    g.add_argument(
        "--launcher-config",
        default=None,
        metavar="YAML",
        help="YAML with the launcher options (keys as the flags below, e.g. time_min: 240, "
        "sbatch: {account: abc}); flags override it",
    )
    for flag, (key, kind) in _FLAGS.items():
        if key == "array_parallelism" and not sweep:
            continue
        g.add_argument(
            flag,
            dest=f"slurm_{key}",
            type=kind,
            default=None,
            metavar=key.split("_")[0].upper(),
            help=LauncherConfig.model_fields[key].description,
        )
    g.add_argument(
        "--sbatch",
        dest="slurm_sbatch",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra sbatch flag, e.g. --sbatch account=abc --sbatch qos=high (repeatable)",
    )
    g.add_argument(
        "--slurm-folder",
        default=None,
        metavar="DIR",
        help="submitit's folder (job scripts, pickles, logs); default: "
        + ("OUT/slurm" if sweep else "<parent of --out>/slurm_logs"),
    )
    g.add_argument(
        "--no-wait",
        action="store_true",
        help="return once the job(s) are submitted (default: wait for them to end"
        + (", then write the report)" if sweep else ")"),
    )


def launcher_config(args: argparse.Namespace) -> Optional[LauncherConfig]:
    """The options of ``--launcher slurm`` (None for ``--launcher local``).

    Raises:
        ConfigError: a SLURM flag without ``--launcher slurm``, a bad value or YAML key (one line).
    """
    given = [f for f, (key, _) in _FLAGS.items() if getattr(args, f"slurm_{key}", None) is not None]
    given += ["--sbatch"] * bool(args.slurm_sbatch) + ["--launcher-config"] * bool(args.launcher_config)
    given += ["--slurm-folder"] * bool(args.slurm_folder) + ["--no-wait"] * bool(args.no_wait)
    if args.launcher != "slurm":
        if given:
            raise ConfigError(f"{given[0]} needs --launcher slurm")
        return None
    data: dict[str, Any] = {}
    prefix = ""
    if args.launcher_config:
        raw = read_yaml(args.launcher_config)
        data = raw["launcher"] if set(raw) == {"launcher"} else raw
        if not isinstance(data, dict):
            raise ConfigError(f"{args.launcher_config}: launcher must be a mapping")
        data = dict(data)
        prefix = f"{args.launcher_config}: "
    data.update({key: v for key, _ in _FLAGS.values() if (v := getattr(args, f"slurm_{key}", None)) is not None})
    extra = dict(data.get("sbatch") or {})
    for item in args.slurm_sbatch:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not _SBATCH_KEY.fullmatch(key):
            raise ConfigError(
                f"--sbatch {item!r} must look like KEY=VALUE, KEY an sbatch option without its dashes "
                f"(e.g. --sbatch account=abc; an option without a value as KEY=, e.g. --sbatch exclusive=)"
            )
        extra[key] = value.strip()
    if extra:
        data["sbatch"] = extra
    return from_dict(LauncherConfig, data, prefix)


def split_launcher_argv(argv: Sequence[str], sweep: bool = False) -> list[str]:
    """``argv`` without the launcher flags (what each job runs)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_launcher_args(p, sweep=sweep)
    _, rest = p.parse_known_args(list(argv))
    return rest


def _submitit() -> Any:
    """submitit, told to ask for SIGUSR1 before the time limit (the trainer's preemption signal)."""
    os.environ["SUBMITIT_PREEMPT_SIGNAL"] = PREEMPT_SIGNAL  # the jobs inherit it (sbatch exports the env)
    try:
        import submitit
    except ModuleNotFoundError:
        raise ConfigError("--launcher slurm needs submitit: pip install 'submitit>=1.5'") from None
    submitit.JobEnvironment.USR_SIG = PREEMPT_SIGNAL  # also when submitit was imported before
    return submitit


class SubmissionFailed(RunFailed):
    """``sbatch`` refused the submission; nothing was submitted and submitit's files are removed."""


def check_controller() -> None:
    """Raise one :class:`RunFailed` line (``sinfo``'s own message) unless the SLURM controller answers."""
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise RunFailed(
            "--launcher slurm: the SLURM client tools (sinfo, sbatch) are not installed here; submit from "
            "a host of the cluster"
        ) from None
    except (OSError, subprocess.SubprocessError) as e:
        raise RunFailed(f"--launcher slurm: sinfo failed ({e}); nothing was submitted") from None
    if r.returncode != 0:
        said = [t.strip() for t in (r.stderr or r.stdout).splitlines() if t.strip()]
        why = said[-1] if said else f"sinfo exit status {r.returncode}"
        conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
        raise RunFailed(
            f"--launcher slurm: the SLURM controller cannot be reached ({why}); nothing was submitted: "
            f"check the cluster (SLURM_CONF={conf}) and run the command again"
        )


@contextlib.contextmanager
def _submission(folder: Path) -> Iterator[None]:
    """The block that submits: a refusal of sbatch is one :class:`SubmissionFailed` line, its files removed."""
    try:
        with removed_on_failure(folder), contextlib.redirect_stderr(io.StringIO()):
            yield
    except LapheadsError:
        raise
    except Exception as e:  # noqa: BLE001 - submitit's FailedJobError, an sbatch that cannot run
        said = [t.strip() for t in str(e).splitlines() if t.strip()]
        sbatch = [t for t in said if t.startswith("sbatch:")]
        raise SubmissionFailed(
            f"--launcher slurm: sbatch refused the job ({(sbatch or said or [type(e).__name__])[-1]}); "
            f"nothing was submitted"
        ) from None


def make_executor(opts: LauncherConfig, folder: Path, name: str) -> Any:
    """A submitit ``SlurmExecutor`` for ``opts`` writing into ``folder``."""
    submitit = _submitit()
    folder.mkdir(parents=True, exist_ok=True)
    ex = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=opts.max_requeues)
    params: dict[str, Any] = dict(
        job_name=opts.job_name or name,
        nodes=opts.nodes,
        ntasks_per_node=opts.ntasks_per_node,
        cpus_per_task=opts.cpus_per_task,
        time=opts.time_min,
        signal_delay_s=opts.signal_delay_s,
        setup=[f"export OMP_NUM_THREADS={opts.cpus_per_task}", *opts.setup],
        additional_parameters={k: (v if v != "" else True) for k, v in opts.sbatch.items()} or None,
        stderr_to_stdout=False,
    )
    mem = f"{max(1, int(round(opts.mem_gb * 1024)))}M" if opts.mem_gb else ""
    optional = dict(partition=opts.partition, gpus_per_node=opts.gpus_per_node, mem=mem)
    optional["array_parallelism"] = opts.array_parallelism
    params.update({k: v for k, v in optional.items() if v})
    ex.update_parameters(**params)
    return ex


def _now() -> str:
    return datetime.datetime.now().astimezone().strftime("%Y-%m-%dT%H:%M:%S%z")


class TrainJob:
    """What submitit runs (pickled) in every task of a job: ``lapheads train RECIPE ARGV`` in this process."""

    def __init__(self, recipe: str, argv: Sequence[str], out: str | Path, resume: bool = False):
        self.recipe, self.argv, self.out, self.resume = recipe, list(argv), str(out), resume

    def command(self) -> list[str]:
        """The argv of this attempt: a requeued one drops ``--overwrite`` and resumes the run if it started."""
        argv = list(self.argv)
        restarted = self.resume or int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
        if restarted:
            argv = [a for a in argv if a not in ("--overwrite", "--resume")]
            if RunDir(self.out).exists():
                argv.append("--resume")
        return ["train", self.recipe, *argv]

    def __call__(self) -> int:
        main = importlib.import_module("lapheads.cli").main  # imported by name: the CLI sits above the engine
        submitit = _submitit()
        job = submitit.JobEnvironment()
        env_from_slurm(job, apply=True)
        if os.environ.get("SLURM_CPUS_PER_TASK"):
            os.environ.setdefault("OMP_NUM_THREADS", os.environ["SLURM_CPUS_PER_TASK"])
        argv = self.command()
        main_rank = job.global_rank == 0
        if main_rank:
            print(
                f"[slurm] job {job.job_id} task {job.global_rank}/{job.num_tasks} on {job.hostname}: "
                f"lapheads {shlex.join(argv)}",
                flush=True,
            )
            self._record(job, "started", argv)
        try:
            rc = main(argv)
        finally:  # exit without the shutdown collections of every object torch made (~1.5 s; lapheads.cli)
            gc.collect()
            gc.freeze()
        if main_rank:
            stopped = {128 + int(sig): f"stopped by {sig.name}" for sig in (signal.SIGINT, signal.SIGTERM)}
            event = {0: "finished", 128 + signal.SIGUSR1: "requeued", **stopped}.get(rc, f"exit status {rc}")
            self._record(job, event, argv)
        if rc == 128 + signal.SIGUSR1:
            # the trainer stopped at a step with a checkpoint; submitit's handler (back in place)
            # calls self.checkpoint() and requeues the job (rank 0), the other ranks just end
            signal.raise_signal(signal.SIGUSR1)
            return rc
        if rc != 0:
            raise JobFailed(f"lapheads {shlex.join(argv)} ended with exit status {rc} (see the lines above)")
        return rc

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's preemption hook: the same run again, resumed from its newest checkpoint."""
        submitit = _submitit()
        return submitit.helpers.DelayedSubmission(TrainJob(self.recipe, self.argv, self.out, True))

    def _record(self, job: Any, event: str, argv: Sequence[str]) -> None:
        """Append this attempt to ``RUN_DIR/slurm.json`` once the directory holds a run."""
        run = RunDir(self.out)
        if not run.exists():
            return
        attempt = {
            "event": event,
            "time": _now(),
            "job_id": job.job_id,
            "array_job_id": job.array_job_id,
            "array_task_id": job.array_task_id,
            "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            "nodes": list(job.hostnames),
            "num_tasks": job.num_tasks,
            "stdout": str(job.paths.stdout),
            "stderr": str(job.paths.stderr),
            "argv": ["lapheads", *argv],
        }
        try:
            data = run.read_json(RUN_RECORD, "the SLURM attempts of the run", missing={"attempts": []})
            run.write_json(RUN_RECORD, {**data, "attempts": [*data["attempts"], attempt]})
        except (OSError, LapheadsError) as e:  # a record must never fail the run
            print(f"[slurm] not recording this attempt in {run.path / RUN_RECORD}: {e}", file=sys.stderr)


class JobFailed(RuntimeError):
    """A job's ``lapheads train`` ended with an error (its one-line message is in the job's log)."""


def queue_states() -> dict[str, str]:
    """``{job id: state}`` of every job in the queue (array tasks as ``ARRAY_TASK``), from ``squeue``."""
    try:
        r = subprocess.run(["squeue", "-h", "-r", "-o", "%i|%T"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise RunFailed(f"squeue failed: {e}") from None
    if r.returncode != 0:
        raise RunFailed(f"squeue failed: {(r.stderr or r.stdout).strip()}")
    rows = [line.strip().partition("|") for line in r.stdout.splitlines()]
    return {jid: state for jid, _, state in rows if jid}


def job_state(job_id: str, queue: dict[str, str]) -> Optional[str]:
    """The squeue state of ``job_id`` (an array task ``A_T`` is also found under a pending ``A_[..]``)."""
    if job_id in queue:
        return queue[job_id]
    array, _, task = job_id.partition("_")
    for jid, state in queue.items():  # a pending array's tasks may still be listed as A_[0-3%2]
        if task and jid.startswith(f"{array}_[") and _in_range(int(task), jid[len(array) + 2 : -1]):
            return state
    return None


def _in_range(task: int, spec: str) -> bool:
    for part in spec.split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        try:
            if int(lo) <= task <= int(hi or lo):
                return True
        except ValueError:
            continue
    return False


def log_tail(path: Optional[str | Path], lines: int = 5) -> list[str]:
    """The last ``lines`` non-empty lines of a log, without submitit's own lines and tracebacks."""
    if not path or not Path(path).is_file():
        return []
    keep, in_traceback = [], False
    for t in Path(path).read_text(errors="replace").splitlines():
        if t.startswith("Traceback (most recent call last):"):
            in_traceback = True
            continue
        if in_traceback and (not t.strip() or t[:1].isspace()):
            continue
        if in_traceback:  # the exception's own line ends the traceback; JobFailed only repeats the exit status
            in_traceback = False
            if t.startswith(f"{__name__}.JobFailed"):
                continue
        if t.strip() and not t.startswith("submitit "):
            keep.append(t)
    return keep[-lines:]


def _tail(rec: dict, lines: int = 5) -> list[str]:
    """The tail of a job's stderr log, else of its stdout log."""
    return log_tail(rec.get("stderr"), lines) or log_tail(rec.get("stdout"), lines)


def submit_train(
    recipe: str,
    argv: Sequence[str],
    out: str | Path,
    opts: LauncherConfig,
    folder: Optional[str | Path] = None,
    wait: bool = True,
) -> Any:
    """Submit ``lapheads train RECIPE ARGV`` as one job; with ``wait``, until it ends.

    Raises:
        RunFailed: the controller cannot be reached (:func:`check_controller`), or the job failed
            (its error line and log named).
        SubmissionFailed: sbatch refused the job (its message; no file of the submission is left).
    """
    out = Path(out)
    folder = Path(folder) if folder else out.absolute().parent / "slurm_logs"
    check_controller()
    with _submission(folder):
        ex = make_executor(opts, folder, f"lapheads-{recipe}")
        job = ex.submit(TrainJob(recipe, argv, out.absolute()))
    print(
        f"[slurm] submitted job {job.job_id} ({opts.nodes} node(s) x {opts.ntasks_per_node} task(s)): "
        f"{out}; log: {job.paths.stdout} (stderr: {job.paths.stderr})",
        flush=True,
    )
    write_json(
        folder / f"{job.job_id}_lapheads.json",
        {
            "job_id": job.job_id,
            "run": str(out.absolute()),
            "recipe": recipe,
            "argv": list(argv),
            "submitted": _now(),
            "stdout": str(job.paths.stdout),
            "stderr": str(job.paths.stderr),
            "options": opts.model_dump(),
        },
    )
    if not wait:
        return job
    while job_state(job.job_id, queue_states()) is not None:
        time.sleep(opts.poll_s)
    if RunDir(out).state() != "done":
        tail = _tail({"stderr": job.paths.stderr, "stdout": job.paths.stdout})
        raise RunFailed(
            f"job {job.job_id} ended without finishing {out}: {tail[-1] if tail else 'no log'} "
            f"(log: {job.paths.stderr}); continue it with --resume"
        )
    for line in log_tail(job.paths.stdout, 50):  # the run's result lines, as a local run prints them
        if not line.startswith("[slurm]"):
            print(line)
    return job


class SweepJobs:
    """``SWEEP/slurm/jobs.json``: each point's current job and every earlier submission."""

    def __init__(self, out: Path, folder: Optional[str | Path] = None):
        self.out = Path(out)
        self.folder = Path(folder) if folder else self.out / "slurm"
        self.path = self.out / "slurm" / JOBS_FILE
        data = read_json(self.path, "the SLURM jobs of a sweep", missing={})
        self.points: dict[str, dict] = data.get("points", {})
        self.history: list[dict] = data.get("history", [])

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, {"points": self.points, "history": self.history})

    def queued(self, queue: dict[str, str]) -> dict[str, str]:
        """``{point: state}`` of the points whose current job is still in the queue."""
        states = {name: job_state(rec["job_id"], queue) for name, rec in self.points.items()}
        return {name: state for name, state in states.items() if state is not None}


def submit_sweep(
    recipe: str,
    todo: Sequence[tuple[Path, Sequence[str], bool]],
    out: Path,
    opts: LauncherConfig,
    folder: Optional[str | Path] = None,
    wait: bool = True,
    quiet: bool = False,
) -> None:
    """Submit the grid runs ``todo`` (``(run directory, lapheads train ARGV, resumes)`` each) as one array
    job, one task per point, except points whose earlier job is still queued; with ``wait``, until all end.

    Raises:
        RunFailed: some points did not finish (the first one's last log line and log named).
        SubmissionFailed: sbatch refused the array job (its message; no file of the submission is left).
    """
    records = SweepJobs(out, folder)
    still = records.queued(queue_states())
    submit = [t for t in todo if t[0].name not in still]
    for path, _, _ in todo:
        if path.name in still and not quiet:
            print(
                f"[sweep] {path.name}: still {still[path.name].lower()} as job "
                f"{records.points[path.name]['job_id']}; not submitted again"
            )
    if submit:
        with _submission(records.folder):
            ex = make_executor(opts, records.folder, f"lapheads-{recipe}")
            with ex.batch():
                jobs = [ex.submit(TrainJob(recipe, argv, Path(path).absolute())) for path, argv, _ in submit]
        stamp = _now()
        for (path, _, resume), job in zip(submit, jobs):
            rec = {
                "job_id": job.job_id,
                "array_job_id": job.job_id.split("_")[0],
                "submitted": stamp,
                "resume": resume,
                "stdout": str(job.paths.stdout),
                "stderr": str(job.paths.stderr),
            }
            records.points[path.name] = rec
            records.history.append({"point": path.name, **rec})
        records.save()
        if not quiet:
            print(
                f"[sweep] submitted {len(jobs)} point(s) as array job {jobs[0].job_id.split('_')[0]} "
                f"(logs in {records.folder}; `lapheads sweep --status {out}` shows them)",
                flush=True,
            )
    if not wait:
        return
    names = [path.name for path, _, _ in todo]
    seen: dict[str, str] = {}
    while True:
        live = {n: s for n, s in records.queued(queue_states()).items() if n in names}
        if not quiet:
            for n in names:
                now = "done" if RunDir(out / n).state() == "done" else live.get(n, "ended").lower()
                if seen.get(n) != now:
                    seen[n] = now
                    jid = records.points.get(n, {}).get("job_id", "?")
                    print(f"[sweep] {n}: {now} (job {jid})", flush=True)
        if not live:
            break
        time.sleep(opts.poll_s)
    failed = [path for path, _, _ in todo if RunDir(path).state() != "done"]
    if failed:
        first = records.points.get(failed[0].name, {})
        tail = _tail(first)
        more = f" ({len(failed) - 1} more)" if len(failed) > 1 else ""
        raise RunFailed(
            f"point {failed[0].name}{more} did not finish: {tail[-1] if tail else 'no log'} "
            f"(log: {first.get('stderr')}); `lapheads sweep --status {out}` lists them, and "
            f"`lapheads sweep --resume --out {out}` resubmits the unfinished points"
        )


def sweep_status(out: Path, names: Sequence[str], lines: int = 5) -> list[dict]:
    """Each point of a sweep: ``pending`` / ``running`` (job id) / ``done`` / ``failed`` (log tail) /
    ``stopped`` (started by a local sweep, unfinished) / ``not started`` / ``unknown`` (squeue failed)."""
    records = SweepJobs(out)
    unreachable = ""
    try:
        queue = queue_states() if records.points else {}
    except RunFailed as e:  # no cluster from here: what is not done is unknown, not failed
        queue, unreachable = {}, str(e)
    rows = []
    for name in names:
        rec = records.points.get(name, {})
        jid = rec.get("job_id")
        state = job_state(jid, queue) if jid else None
        run = RunDir(out / name).state()
        row: dict[str, Any] = {"point": name, "job_id": jid, "log": rec.get("stderr")}
        if run == "done":
            row["state"] = "done"
        elif state in ACTIVE:
            row["state"] = "running"
        elif state is not None:
            row["state"] = "pending"
        elif jid is None:
            row["state"] = "not started" if run == "new" else "stopped"
        elif unreachable:
            row.update(state="unknown", tail=[unreachable])
        else:
            row.update(state="failed", tail=_tail(rec, lines), resumable=run == "partial")
        rows.append(row)
    return rows


def print_status(out: Path, names: Sequence[str]) -> int:
    """``lapheads sweep --status``: one line per point (plus a failed point's last log lines)."""
    rows = sweep_status(out, names)
    width = max([len(r["point"]) for r in rows] + [5])
    for r in rows:
        extra = f"job {r['job_id']}" if r["job_id"] and r["state"] in ("running", "pending", "failed") else ""
        if r["state"] == "failed" and r.get("resumable"):
            extra += ", has a checkpoint"
        print(f"{r['point']:<{width}}  {r['state']:<11}  {extra}".rstrip())
        if r["state"] == "unknown":
            print(f"{'':<{width}}  | {r['tail'][0]}")
        if r["state"] == "failed":
            if r.get("log"):
                print(f"{'':<{width}}  log: {r['log']}")
            for line in r.get("tail", []):
                print(f"{'':<{width}}  | {line}")
    print(", ".join(f"{v} {k}" for k, v in collections.Counter(r["state"] for r in rows).items()))
    return 0
