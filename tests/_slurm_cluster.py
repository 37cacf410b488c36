"""A real one-node SLURM cluster on this machine, for tests/test_slurm.py (and by hand).

::

    python tests/_slurm_cluster.py up /tmp/lapheads-slurm    # prints: export SLURM_CONF=...
    python tests/_slurm_cluster.py down /tmp/lapheads-slurm  # stops the daemons it started, by pid

Debian's ``slurm-wlm`` and ``munge`` give slurmctld + slurmd on localhost (``proctrack/linuxproc``,
``task/none``, accounting off). :func:`start_cluster`:

1. installs the two packages with ``apt-get`` where they are missing and the user is root
   (:class:`ClusterUnavailable` with the reason otherwise: the tests skip with it);
2. makes the munge key where there is none (``mungekey -c``) and starts ``munged`` unless a munged
   already answers on the default socket;
3. writes ``slurm.conf`` for this host into a directory of its own (free ports, its own state and
   spool directories; ``SLURM_CONF`` points the clients at it, so a cluster configured in
   ``/etc/slurm`` is never touched), starts ``slurmctld -D`` and ``slurmd -D``;
4. waits until ``srun true`` works (about 10 s from a cold start).

:meth:`Cluster.stop` ends exactly the processes it started, by their ids (their pids are also in
``DIR/pids``, which ``down`` reads).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

PACKAGES = ("slurm-wlm", "munge")
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")


class ClusterUnavailable(RuntimeError):
    """No local cluster can be started here (the reason is the message)."""


@dataclass
class Cluster:
    """A started cluster: its directory, ``slurm.conf`` and the processes this module started."""

    root: Path
    conf: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    cpus: int = 1

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, srun, squeue, submitit) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def stop(self) -> None:
        """Cancel the jobs left in this cluster's queue (until it is empty, at most 30 s), then SIGTERM
        to each process this module started (slurmd first), SIGKILL after 10 s."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            env = dict(os.environ, **self.env)
            try:
                subprocess.run(
                    ["scancel", "--full", "--user", str(os.getuid())], env=env, capture_output=True, timeout=30
                )
                deadline = time.time() + 30
                while time.time() < deadline:
                    q = subprocess.run(
                        ["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=30
                    )
                    if q.returncode != 0 or not q.stdout.strip():
                        break
                    time.sleep(0.5)
            except (OSError, subprocess.SubprocessError):
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        (self.root / "pids").unlink(missing_ok=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _have(*tools: str) -> bool:
    return all(shutil.which(t) or Path("/usr/sbin", t).exists() for t in tools)


def ensure_packages() -> None:
    """Install slurm-wlm and munge with apt where missing (root only); ClusterUnavailable otherwise."""
    if _have("slurmctld", "slurmd", "munged", "srun", "sbatch"):
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable("slurm-wlm / munge are not installed and installing them needs root")
    if not shutil.which("apt-get"):
        raise ClusterUnavailable("slurm-wlm / munge are not installed and there is no apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    r = subprocess.run(
        ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
        r = subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    if r.returncode != 0 or not _have("slurmctld", "slurmd", "munged", "srun"):
        raise ClusterUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {(r.stderr or r.stdout)[-300:]}")


def _munge_works() -> bool:
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=5)
        if cred.returncode != 0:
            return False
        return subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _start_munge(cluster: Cluster) -> None:
    if _munge_works():
        return
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True, timeout=30)
        shutil.chown(key, "munge", "munge")
    MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
    shutil.chown(MUNGE_SOCKET.parent, "munge", "munge")
    log = open(cluster.root / "munged.log", "ab")
    cluster.procs["munged"] = subprocess.Popen(
        ["munged", "-F"], user="munge", group="munge", stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )
    deadline = time.time() + 15
    while not _munge_works():
        if cluster.procs["munged"].poll() is not None or time.time() > deadline:
            raise ClusterUnavailable(f"munged did not start: {(cluster.root / 'munged.log').read_text()[-300:]}")
        time.sleep(0.1)


def write_conf(root: Path, cpus: int) -> Path:
    """``slurm.conf`` of a one-node cluster on this host, with everything under ``root``."""
    host = socket.gethostname().split(".")[0]
    mem_mb = 1024
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_mb = int(line.split()[1]) // 1024 // 2
    except OSError:
        pass
    for d in ("state", "spool", "log"):
        (root / d).mkdir(parents=True, exist_ok=True)
    text = f"""\
ClusterName=lapheads
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=3600
KillWait=10
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
SchedulerParameters=sched_interval=1
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
    conf = root / "slurm.conf"
    conf.write_text(text)
    return conf


def start_cluster(root: str | Path, cpus: Optional[int] = None, timeout: float = 60) -> Cluster:
    """Start munged (where needed), slurmctld and slurmd with their own ``slurm.conf`` under ``root``.

    ``cpus``: CPUs the node offers (default: this machine's); more than the machine has is allowed
    (``config_overrides``), e.g. to run four one-CPU array tasks at once on two cores.

    Raises:
        ClusterUnavailable: not root / no apt and the packages are missing, or a daemon did not start.
    """
    if sys.platform != "linux":
        raise ClusterUnavailable("the local SLURM cluster needs Linux")
    ensure_packages()
    if os.geteuid() != 0:
        raise ClusterUnavailable("starting slurmctld/slurmd/munged for the tests needs root")
    root = Path(root).absolute()
    root.mkdir(parents=True, exist_ok=True)
    cpus = cpus or os.cpu_count() or 1
    cluster = Cluster(root, write_conf(root, cpus), cpus=cpus)
    try:
        _start_munge(cluster)
        env = dict(os.environ, **cluster.env)
        for name in ("slurmctld", "slurmd"):
            log = open(root / "log" / f"{name}.out", "ab")
            cluster.procs[name] = subprocess.Popen(
                [name, "-D", "-f", str(cluster.conf)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            if name == "slurmctld":
                time.sleep(0.5)
        (root / "pids").write_text("".join(f"{p.pid}\n" for p in cluster.procs.values()))
        wait_until_ready(cluster, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def wait_until_ready(cluster: Cluster, timeout: float = 60) -> None:
    """Until ``srun true`` works (the node registered, the partition is up)."""
    env = dict(os.environ, **cluster.env)
    deadline = time.time() + timeout
    last = ""
    while time.time() < deadline:
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                logs = cluster.root / "log" / f"{name}.log"
                tail = logs.read_text(errors="replace")[-500:] if logs.exists() else ""
                raise ClusterUnavailable(f"{name} exited with status {proc.returncode}: {tail}")
        r = subprocess.run(
            ["srun", "--immediate=5", "-N1", "-n1", "true"], env=env, capture_output=True, text=True, timeout=30
        )
        if r.returncode == 0:
            return
        last = (r.stderr or r.stdout).strip()
        time.sleep(0.5)
    raise ClusterUnavailable(f"the local SLURM cluster did not accept `srun true` within {timeout:.0f} s: {last}")


def slow_steps():
    """Engine callback (``LAPHEADS_CALLBACKS=_slurm_cluster:slow_steps``, ``tests/`` on ``PYTHONPATH``):
    every optimizer step sleeps ``LAPHEADS_TEST_STEP_SLEEP`` seconds, so a signal lands mid-run."""
    delay = float(os.environ.get("LAPHEADS_TEST_STEP_SLEEP", "0") or 0)
    if delay <= 0:
        return None
    from lapheads.engine.callbacks import Callback

    class _Slow(Callback):
        def on_step_end(self, step: int) -> None:
            time.sleep(delay)

    return _Slow()


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print(__doc__.split("::")[1].split("\n\n")[1], file=sys.stderr)
        return 2
    root = Path(argv[1]).absolute()
    if argv[0] == "down":
        pids = [int(p) for p in (root / "pids").read_text().split()] if (root / "pids").exists() else []
        for pid in reversed(pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        (root / "pids").unlink(missing_ok=True)
        return 0
    cluster = start_cluster(root)
    for proc in cluster.procs.values():  # leave the daemons running after this script ends
        proc.returncode = 0
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
