"""``--launcher slurm`` against a real one-node SLURM cluster (tests/_slurm_cluster.py), not a mock.

The last four tests need the cluster (``slow``); the first ones check the launcher's own parts
without it. The module starts slurmctld + slurmd (and munged where none answers) once, with their own
``slurm.conf`` (``SLURM_CONF``), and stops them by pid at the end; where that cannot be done (not
root and the packages missing, no apt, not Linux) every test is skipped with the reason. The node
offers 4 CPUs on 2 cores (``config_overrides``) so that the 2x2 grid's four array tasks start at
once: their start-up (imports) dominates, not their 3 optimizer steps.

* a 2x2 grid (k x seed) as one array job, waited for, to a finished report; ``--status``;
* a point warned with SIGUSR1 (what SLURM sends before a time limit / preemption) mid-run: it
  checkpoints, requeues itself through submitit and the requeued attempt resumes exactly (final
  weights equal to an uninterrupted run's);
* a point cancelled with ``scancel`` mid-run, then ``lapheads sweep --resume``: only that point is
  submitted again and it resumes from its checkpoint;
* a 2-task job (gloo, one node): torch.distributed from SLURM's environment, no torchrun; its SGD
  step equals the 1-process step.

Jobs inherit the test's environment (sbatch exports it): one thread, the suite's callbacks plus
``_slurm_cluster:slow_steps`` (``LAPHEADS_TEST_STEP_SLEEP`` seconds per step, for the tests that
signal a run mid-way). A requeued job is held by SLURM for about two minutes (its ``BeginTime``, the credential
lifetime); the test releases it a few seconds after the requeue with ``scontrol update StartTime=now``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _slurm_cluster import ClusterUnavailable, start_cluster

from lapheads.cli import main as cli
from lapheads.engine.checkpoint import load_tensors
from lapheads.recipes.shipped import CONFIG_DIR

# One worker runs them all: the cluster is a module fixture, and its munged (a machine-wide socket)
# would be stopped under another worker's cluster by this one's teardown.
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("slurm")]

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(CONFIG_DIR / "classify" / "digits.yaml")
TINY = [
    "--config",
    DIGITS,
    "--set",
    "model.depth=1",
    "--set",
    "model.num_heads=2",
    "--set",
    "model.embed_dim=32",
    "--set",
    "train.progress=false",
    "--set",
    "data.batch_size=16",
    "--set",
    "data.max_eval_items=16",
    "--set",
    "train.log_every=1",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = Path("/tmp") / f"lapheads-slurm-{os.getpid()}"  # short paths: slurmd's sockets live here
    try:
        c = start_cluster(root, cpus=4)
    except ClusterUnavailable as e:
        pytest.skip(f"no local SLURM cluster: {e}")
    mp = pytest.MonkeyPatch()
    mp.setenv("SLURM_CONF", str(c.conf))
    mp.setenv("OMP_NUM_THREADS", "1")
    mp.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cbs = [s for s in os.environ.get("LAPHEADS_CALLBACKS", "").split(",") if s]
    mp.setenv("LAPHEADS_CALLBACKS", ",".join([*cbs, "_slurm_cluster:slow_steps"]))
    mp.delenv("LAPHEADS_TEST_STEP_SLEEP", raising=False)
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    try:
        yield c
    finally:
        mp.undo()
        c.stop()


def _until(what: str, check, timeout: float = 180, every: float = 0.3):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def _squeue() -> dict[str, tuple[str, str]]:
    r = subprocess.run(["squeue", "-h", "-r", "-o", "%i|%T|%r"], capture_output=True, text=True, check=True)
    return {i: (s, why) for i, s, why in (line.split("|") for line in r.stdout.splitlines() if line)}


def _logged_steps(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return len([ln for ln in lines if '"loss"' in ln])


def _release_requeued(job_id: str) -> bool:
    """True once ``job_id`` runs again; a requeued job waiting for its BeginTime is released now."""
    state = _squeue().get(job_id)
    if state is None:
        return True  # already ran and ended
    if state[0] == "PENDING" and "BeginTime" in state[1]:
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
    return state[0] == "RUNNING"


def _same_weights(a: Path, b: Path) -> None:
    ta, tb = load_tensors(a / "final" / "model.safetensors"), load_tensors(b / "final" / "model.safetensors")
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def test_launcher_flags_yaml_and_argv(tmp_path, capsys):
    from lapheads.engine.slurm import LauncherConfig, launcher_config, split_launcher_argv

    out = tmp_path / "never"
    assert cli(["train", "classify", *TINY, "--out", str(out), "--partition", "gpu"]) == 2
    assert "--partition needs --launcher slurm" in capsys.readouterr().err
    assert not out.exists()
    yaml_file = tmp_path / "slurm.yaml"
    yaml_file.write_text("launcher:\n  partition: gpu\n  time_min: 240\n  sbatch: {account: abc}\n")
    import argparse

    from lapheads.engine.slurm import add_launcher_args

    p = argparse.ArgumentParser()
    add_launcher_args(p, sweep=True)
    args = p.parse_args(
        [
            "--launcher",
            "slurm",
            "--launcher-config",
            str(yaml_file),
            "--time-min",
            "30",
            "--gpus-per-node",
            "4",
            "--sbatch",
            "qos=high",
            "--sbatch",
            "exclusive=",
        ]
    )
    opts = launcher_config(args)
    assert isinstance(opts, LauncherConfig)
    assert (opts.partition, opts.time_min, opts.ntasks_per_node) == ("gpu", 30, 4)
    assert opts.sbatch == {"account": "abc", "qos": "high", "exclusive": ""}
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: 0\n")
    with pytest.raises(Exception, match="nodes"):
        launcher_config(p.parse_args(["--launcher", "slurm", "--launcher-config", str(bad)]))
    argv = ["--out", "x", "--launcher", "slurm", "--nodes", "2", "--set", "a.b=1", "--sbatch", "qos=high", "--no-wait"]
    assert split_launcher_argv(argv) == ["--out", "x", "--set", "a.b=1"]


def test_torch_distributed_env_from_a_slurm_job(monkeypatch):
    from lapheads.engine.dist import env_from_slurm
    from lapheads.engine.slurm import _in_range, job_state

    class Job:
        global_rank, local_rank, num_tasks, num_nodes, node = 3, 1, 4, 2, 1
        hostnames, raw_job_id = ["node7", "node8"], "123"

    for var in ("RANK", "WORLD_SIZE", "LAPHEADS_MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    env = env_from_slurm(Job())
    assert env == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "node7",
        "MASTER_PORT": str(20000 + 123),
    }
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert env_from_slurm(Job()) == {}  # torchrun's own variables win
    assert job_state("5_2", {"5_[0-3%2]": "PENDING"}) == "PENDING" and job_state("5_7", {"5_[0-3]": "PENDING"}) is None
    assert _in_range(4, "0-2,4") and not _in_range(3, "0-2,4")


@pytest.mark.slow
def test_a_refused_submission_is_one_line_and_leaves_no_submission_files(cluster, tmp_path, monkeypatch, capsys):
    # sbatch refuses an option it does not know: the line quotes it; submitit's job script and
    # pickle, the sweep's record and its folders are removed; an earlier job's log folder stays
    from _reliability_helpers import snapshot

    monkeypatch.chdir(tmp_path)
    logs = tmp_path / "runs" / "slurm_logs"
    logs.mkdir(parents=True)
    (logs / "keep.txt").write_text("an earlier job's")
    before = snapshot(tmp_path)
    bad = ["--launcher", "slurm", "--sbatch", "nosuchopt=1", "--no-wait"]
    sweep = ["sweep", *TINY, "--laplacian-heads", "0", "--seeds", "0", "--out", str(tmp_path / "sw")]
    for argv in (["train", "classify", *TINY, "--out", str(tmp_path / "runs" / "a")], sweep):
        capsys.readouterr()
        assert cli([*argv, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert "sbatch refused the job" in err[0] and "unrecognized option '--nosuchopt=1'" in err[0], err
        assert snapshot(tmp_path) == before


def test_2x2_grid_as_an_array_job_to_a_report(cluster, tmp_path, capsys):
    out = tmp_path / "sweep"
    t0 = time.time()
    rc = cli(
        [
            "sweep",
            *TINY,
            "--set",
            "train.max_steps=3",
            "--laplacian-heads",
            "0,all",
            "--seeds",
            "0,1",
            "--out",
            str(out),
            "--launcher",
            "slurm",
            "--time-min",
            "10",
            "--cpus-per-task",
            "1",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    elapsed = time.time() - t0
    names = ["lap0_seed0", "lap0_seed1", "lapall_seed0", "lapall_seed1"]
    assert (out / "report" / "report.html").is_file()
    jobs = json.loads((out / "slurm" / "jobs.json").read_text())["points"]
    assert sorted(jobs) == names
    assert len({j["array_job_id"] for j in jobs.values()}) == 1, "one array job for the whole grid"
    assert sorted(j["job_id"].split("_")[1] for j in jobs.values()) == ["0", "1", "2", "3"]
    for n in names:
        assert (out / n / "final" / "model.json").is_file()
        rec = json.loads((out / n / "slurm.json").read_text())["attempts"]
        assert rec[-1]["event"] == "finished" and rec[-1]["job_id"] == jobs[n]["job_id"]
        assert Path(rec[-1]["stdout"]).is_file()
    assert cli(["sweep", "--status", str(out)]) == 0
    status = capsys.readouterr().out
    assert status.strip().splitlines()[-1] == "4 done", status
    print(f"\n2x2 grid: sbatch to report in {elapsed:.1f} s")


def _requeued_and_released(job_id: str) -> None:
    _until("the job to be requeued", lambda: _squeue().get(job_id, ("",))[0] == "PENDING", every=0.1)
    # slurmd refuses a credential made in the second its job was killed ("Job credential revoked"),
    # which ends the job for good: release it only after that second
    time.sleep(2.5)
    _until("the requeued job to run again", lambda: _release_requeued(job_id))


@pytest.mark.slow
def test_sigusr1_and_scontrol_requeue_checkpoint_requeue_and_resume_exactly(cluster, tmp_path, monkeypatch, capsys):
    """SIGUSR1 (submitit requeues the job itself), then ``scontrol requeue`` (SIGTERM, SLURM requeues):
    three attempts, one curve, the final weights of an uninterrupted run."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    steps = ["--set", "train.max_steps=16"]
    monkeypatch.setenv("LAPHEADS_TEST_STEP_SLEEP", "0.4")  # the job inherits it at submission
    assert (
        cli(
            [
                "train",
                "classify",
                *TINY,
                *steps,
                "--out",
                str(run),
                "--launcher",
                "slurm",
                "--time-min",
                "10",
                "--no-wait",
            ]
        )
        == 0
    )
    monkeypatch.delenv("LAPHEADS_TEST_STEP_SLEEP")
    job_id = capsys.readouterr().out.split("submitted job ")[1].split()[0]
    assert cli(["train", "classify", *TINY, *steps, "--out", str(ref)]) == 0  # the uninterrupted run, meanwhile
    t0 = time.time()
    _until("4 logged steps", lambda: _logged_steps(run) >= 4)
    t1 = time.time()
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    _requeued_and_released(job_id)
    t2 = time.time()
    _until("9 logged steps", lambda: _logged_steps(run) >= 9)  # the first attempt stopped at step 4 or 5
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    _requeued_and_released(job_id)
    _until("the job to end", lambda: job_id not in _squeue())
    print(
        f"\nrequeue: first steps after {t1 - t0:.1f} s, running again after {t2 - t1:.1f} s, "
        f"ended after {time.time() - t2:.1f} s"
    )
    attempts = json.loads((run / "slurm.json").read_text())["attempts"]
    assert [a["event"] for a in attempts] == ["requeued", "started", "stopped by SIGTERM", "started", "finished"]
    assert [a["restart_count"] for a in attempts] == [0, 1, 1, 2, 2]
    assert all(a["argv"][-1] == "--resume" for a in attempts[1:])
    starts = json.loads((run / "meta.json").read_text())["starts"]
    assert [s["resume"] for s in starts] == [False, True, True]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "split" not in r] == list(range(1, 17)), "one curve, no step twice"
    _same_weights(run, ref)


@pytest.mark.slow
def test_cancelled_point_is_resumed_by_sweep_resume(cluster, tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    argv = [
        "sweep",
        *TINY,
        "--set",
        "train.max_steps=12",
        "--laplacian-heads",
        "0",
        "--seeds",
        "0,1",
        "--out",
        str(out),
        "--launcher",
        "slurm",
        "--time-min",
        "10",
        "--no-report",
    ]
    monkeypatch.setenv("LAPHEADS_TEST_STEP_SLEEP", "0.4")
    assert cli([*argv, "--no-wait"]) == 0
    monkeypatch.delenv("LAPHEADS_TEST_STEP_SLEEP")
    capsys.readouterr()
    jobs = json.loads((out / "slurm" / "jobs.json").read_text())["points"]
    victim, other = out / "lap0_seed1", out / "lap0_seed0"
    _until("3 logged steps of the point to cancel", lambda: _logged_steps(victim) >= 3)
    subprocess.run(["scancel", jobs["lap0_seed1"]["job_id"]], check=True)
    _until("the cancelled job to end", lambda: jobs["lap0_seed1"]["job_id"] not in _squeue())
    assert cli(["sweep", "--status", str(out)]) == 0
    status = capsys.readouterr().out
    line = next(ln for ln in status.splitlines() if ln.startswith("lap0_seed1"))
    assert "failed" in line and jobs["lap0_seed1"]["job_id"] in line and "has a checkpoint" in line, status
    assert "interrupted by SIGTERM" in status, status  # the log's last lines
    assert (victim / "checkpoints").is_dir() and not (victim / "final").exists()
    # the other point may still run: --resume neither resubmits it nor a finished one
    assert cli(["sweep", "--resume", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "submitted 1 point(s)" in printed, printed
    hist = json.loads((out / "slurm" / "jobs.json").read_text())["history"]
    assert [h["point"] for h in hist].count("lap0_seed0") == 1 and [h["point"] for h in hist].count("lap0_seed1") == 2
    assert hist[-1]["resume"] is True
    for run in (victim, other):
        assert (run / "final" / "model.json").is_file()
    assert [s["resume"] for s in json.loads((victim / "meta.json").read_text())["starts"]] == [False, True]
    steps = [
        r["step"] for r in map(json.loads, (victim / "metrics.jsonl").read_text().splitlines()) if "split" not in r
    ]
    assert steps == list(range(1, 13))


@pytest.mark.slow
def test_two_task_job_step_equals_one_process(cluster, tmp_path):
    """One SGD step: a 2-task SLURM job x 8 images (gloo, no torchrun) gives the weights of 1 process x 16."""
    common = [
        *TINY,
        "--set",
        "train.max_steps=1",
        "--set",
        "optim.name=sgd",
        "--set",
        "optim.momentum=0",
        "--set",
        "optim.lr=0.5",
        "--set",
        "optim.weight_decay=0",
        "--set",
        "train.warmup_ratio=0",
        "--set",
        "train.clip_grad=0",
        "--set",
        "train.schedule=constant",
        "--set",
        "aug.label_smoothing=0",
        "--set",
        "train.device=cpu",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    assert (
        cli(
            [
                "train",
                "classify",
                *common,
                "--out",
                str(two),
                "--set",
                "data.batch_size=8",
                "--launcher",
                "slurm",
                "--tasks-per-node",
                "2",
                "--cpus-per-task",
                "1",
                "--time-min",
                "10",
            ]
        )
        == 0
    )
    assert cli(["train", "classify", *common, "--out", str(one), "--set", "data.batch_size=16"]) == 0
    a, b = load_tensors(one / "final" / "model.safetensors"), load_tensors(two / "final" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5)
    assert json.loads((two / "meta.json").read_text())["starts"][0]["world_size"] == 2
    loss_one = [json.loads(ln) for ln in (one / "metrics.jsonl").read_text().splitlines()][0]["loss"]
    loss_two = [json.loads(ln) for ln in (two / "metrics.jsonl").read_text().splitlines()][0]["loss"]
    assert abs(loss_one - loss_two) < 1e-5
    attempts = json.loads((two / "slurm.json").read_text())["attempts"]
    assert attempts[-1]["num_tasks"] == 2
