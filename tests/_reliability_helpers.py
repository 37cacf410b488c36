"""Shared pieces of the reliability tests (resume under SIGKILL, bad inputs, NaN guard, DDP faults).

Design choices:

* One tiny classify model (2 layers, 32 wide, 16 px digits) so that a run of 60 optimizer steps
  with a checkpoint every 3 steps costs a few seconds, and kills land in every phase of the loop.
* Subprocess runs use one intra-op thread and the same environment as their reference run, so
  "bit-identical" compares the same arithmetic.
* ``ForkServer(fsync_delay=...)`` widens (never changes) the checkpoint-writing code path: it sleeps in
  the engine's fsync helpers so that a kill can land between the files of one checkpoint, between
  the rename and the ``latest`` pointer, and so on. The product code runs unchanged otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from lapheads.engine.checkpoint import latest_checkpoint, list_checkpoints, load_tensors, safe_torch_load
from lapheads.recipes.shipped import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(CONFIG_DIR / "classify" / "digits.yaml")

TINY = [
    "--set",
    "model.embed_dim=32",
    "--set",
    "model.depth=2",
    "--set",
    "model.num_heads=2",
    "--set",
    "model.img_size=16",
    "--set",
    "model.patch_size=4",
    "--set",
    "train.progress=false",
    "--set",
    "data.batch_size=16",
    "--set",
    "train.log_every=1",
    "--set",
    "data.max_eval_items=32",
]


def classify_argv(out: Path, *extra: str) -> list[str]:
    """``train classify`` on digits with the tiny model (extra ``--set``/flags appended)."""
    return ["train", "classify", "--config", DIGITS, "--out", str(out), *TINY, *extra]


# torch's launcher as the `torchrun` console script runs it (its module's main), then the exit without
# the shutdown garbage collections that lapheads' own console takes (lapheads.cli): ~1.5 s per launch.
_TORCHRUN = (
    "import runpy\n"
    "try:\n"
    "    runpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)\n"
    "finally:\n"
    "    from lapheads.cli import _spare_the_exit_collections\n"
    "    _spare_the_exit_collections()\n"
)


def free_port() -> int:
    """A free local TCP port (``--master_port=0`` made the workers dial 127.0.0.1:0 in this torch version)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str) -> list[str]:
    """The argv of ``torchrun --master_port=<free port> ARGS``."""
    return [sys.executable, "-c", _TORCHRUN, f"--master_port={free_port()}", *args]


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", LAPHEADS_TEST_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("LAPHEADS_DEBUG", None)
    env.update(extra)
    return env


class ForkServer:
    """A Python process that imported lapheads (torch, timm, the classify recipe) once and forks a
    child per command, so a SIGKILL test pays the ~5-15 s interpreter start once, not per kill.

    The children are real processes running the unchanged CLI; several can run at once (a second
    writer against a running one). The server reaps each child as soon as it ends (so a finished
    child is not mistaken for a live one) and reports ``done PID STATUS`` (negative status = killed
    by that signal). With ``fsync_delay`` the engine's fsync helpers sleep that long, making
    checkpoint writes observable.
    """

    def __init__(self, env: dict[str, str], fsync_delay: float = 0.0):
        import subprocess

        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "serve", str(fsync_delay)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(ROOT),
            bufsize=1,
        )
        self._done: dict[int, int] = {}
        assert self._line() == "ready"

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fork server died (rc={self.proc.poll()})")
        return line.strip()

    def _next(self, word: str) -> list[str]:
        """The next reply starting with ``word`` (``done`` replies met on the way are kept)."""
        while True:
            parts = self._line().split()
            if parts[0] == "done" and word != "done":
                self._done[int(parts[1])] = int(parts[2])
                continue
            assert parts[0] == word, parts
            return parts

    def start(self, argv: list[str], log: Path, err: Path | None = None) -> int:
        """Fork a child running ``lapheads argv`` (stdout to ``log``, stderr to ``err`` or also to
        ``log``); returns its pid."""
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log), "err": str(err or log)}) + "\n")
        self.proc.stdin.flush()
        return int(self._next("pid")[1])

    def wait(self, pid: int) -> int:
        """The child's exit status (negative: killed by that signal)."""
        while pid not in self._done:
            _, got, status = self._next("done")
            self._done[int(got)] = int(status)
        return self._done.pop(pid)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _serve(fsync_delay: float) -> None:
    import time
    import traceback

    import lapheads.engine.checkpoint as C

    if fsync_delay > 0:
        _f, _d = C._fsync_file, C._fsync_dir

        def _slow_file(p):
            _f(p)
            time.sleep(fsync_delay)

        def _slow_dir(p):
            _d(p)
            time.sleep(fsync_delay)

        C._fsync_file, C._fsync_dir = _slow_file, _slow_dir
    torch.set_num_threads(1)
    import timm  # noqa: F401
    import timm.data  # noqa: F401
    import timm.loss  # noqa: F401
    import tqdm.auto  # noqa: F401
    from torch.utils import tensorboard  # noqa: F401

    import lapheads.data.images  # noqa: F401
    import lapheads.engine.launch  # noqa: F401
    import lapheads.recipes.classify  # noqa: F401  (the imports every child would pay for)
    import lapheads.timm  # noqa: F401
    import lapheads.vision.transforms  # noqa: F401
    from lapheads.cli import main

    print("ready", flush=True)
    import select

    children: set[int] = set()
    stdin, stdin_open = sys.stdin.buffer.raw, True
    while stdin_open or children:
        for pid in list(children):  # reap promptly: a zombie would still look alive to os.kill(pid, 0)
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                children.discard(pid)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                print(f"done {pid} {code}", flush=True)
        if not stdin_open:
            time.sleep(0.005)
            continue
        if not select.select([stdin], [], [], 0.005)[0]:
            continue
        line = stdin.readline()  # unbuffered: select() sees every byte not read yet
        if not line:
            stdin_open = False
            continue
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:  # child: run the CLI, never return into the server loop
            rc = 3
            # A command started from a terminal has Python's Ctrl-C handler. When the test suite
            # itself runs as a background job (`make test &`, some CI runners), SIGINT arrives
            # ignored and Python keeps it ignored, as the engine does (by design); restore the
            # terminal's disposition so the signal tests test the engine, not the runner.
            import signal

            signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                for target, name in ((1, "log"), (2, "err")):
                    fd = os.open(cmd[name], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(fd, target)
                    os.close(fd)
                sys.stdin.close()
                rc = main(cmd["argv"])
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        children.add(pid)
        print(f"pid {pid}", flush=True)


def check_checkpoint_dir(ckpt_dir: Path) -> int | None:
    """Assert the newest checkpoint ``latest`` names is complete and readable; return its step.

    Returns None when no checkpoint was completed yet (a kill before the first one).
    """
    ck = latest_checkpoint(ckpt_dir)  # raises CheckpointError when `latest` names a partial dir
    if ck is None:
        assert not list_checkpoints(ckpt_dir) or not (ckpt_dir / "latest").exists()
        return None
    names = sorted(p.name for p in ck.iterdir())
    assert {"model.safetensors", "state.pt", "state.json"} <= set(names), (ck, names)
    for f in ck.iterdir():
        if f.suffix == ".safetensors":
            sd = load_tensors(f)
            assert sd and all(torch.isfinite(v).all() for v in sd.values() if v.is_floating_point()), f
    st = safe_torch_load(ck / "state.pt")
    info = json.loads((ck / "state.json").read_text())
    step = int(ck.name.split("_")[1])
    assert st["step"] == info["step"] == step, (ck, st["step"], info["step"])
    return step


def train_steps(run: Path) -> list[int]:
    """Steps of the train records in ``metrics.jsonl`` (val and skip records left out)."""
    steps = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)  # every line must be JSON after a finished run (no torn lines)
        if "split" not in rec and "skipped_nonfinite" not in rec:
            steps.append(rec["step"])
    return steps


def same_weights(a: Path, b: Path) -> bool:
    x, y = load_tensors(a), load_tensors(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def snapshot(path: Path) -> dict[str, str] | None:
    """Relative path -> sha256 of every file under ``path`` (None when it does not exist)."""
    if not path.exists():
        return None
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir():
            out[str(p.relative_to(path)) + "/"] = "dir"
    return out


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "serve":
    sys.path.insert(0, str(ROOT / "src"))
    _serve(float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
