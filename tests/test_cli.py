"""The console entry point (``lapheads``, ``python -m lapheads.cli``) as a process sees it."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys

from lapheads import __version__
from lapheads.cli import _QUIET_ENV, entry


class _Cycle:
    """Cyclic garbage with a finalizer: freed only by a collection, which runs ``__del__``."""

    finalized: list[str] = []

    def __init__(self, name: str):
        self.name, self.me = name, self

    def __del__(self):
        _Cycle.finalized.append(self.name)


def test_entry_collects_the_garbage_then_freezes_the_survivors(monkeypatch, capsys):
    """Shutdown collections would walk every object torch & co. made (~1.5 s per process):
    ``entry`` collects what is garbage now (finalizers run, as at exit) and freezes the rest."""
    gc.collect()
    gc.unfreeze()
    _Cycle("before")
    monkeypatch.setattr(sys, "argv", ["lapheads", "--version"])
    try:
        assert entry() == 0
        assert capsys.readouterr().out.strip() == __version__
        assert _Cycle.finalized == ["before"]  # collected before the freeze, not frozen with it
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lapheads.cli", *args], capture_output=True, text=True, timeout=300)


def test_group_and_sweep_help_print_help_and_exit_0():
    """``lapheads train --help`` lists the recipes, ``lapheads sweep --help`` its flags, both exit 0;
    ``lapheads train`` alone is an error that points at the help."""
    from lapheads.cli import COMMANDS

    r = _run_cli("train", "--help")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    for words, (_, help_) in COMMANDS.items():
        if words[0] == "train":
            assert re.search(rf"^  {words[1]} +{re.escape(help_)}$", r.stdout, re.M), r.stdout
    r = _run_cli("sweep", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: lapheads sweep") and "--laplacian-heads" in r.stdout
    r = _run_cli("train")
    assert r.returncode == 2 and "lapheads train --help" in r.stderr


def test_recipe_help_lists_the_metrics_of_the_recipe():
    from lapheads.recipes import get_recipe

    r = _run_cli("train", "lm", "--help")
    assert r.returncode == 0
    for m in get_recipe("lm").metrics:
        assert m.key in r.stdout


_TINY = [
    "--config",
    "digits",
    "--set",
    "model.embed_dim=16",
    "--set",
    "model.depth=1",
    "--set",
    "model.num_heads=2",
    "--set",
    "train.progress=false",
    "--set",
    "data.max_eval_items=32",
    "--set",
    "train.ckpt_every=1",
    "--set",
    "train.eval_every=0",
]


def test_resume_says_its_step_and_a_finished_run_is_not_recomputed(tmp_path, capsys):
    from lapheads.cli import main as cli

    run = tmp_path / "run"
    assert cli(["train", "classify", "--out", str(run), *_TINY, "--set", "train.max_steps=2"]) == 0
    capsys.readouterr()
    # a longer run: continues from the checkpoint of step 2 and says so
    assert cli(["train", "classify", "--out", str(run), "--resume", "--set", "train.max_steps=3"]) == 0
    err = capsys.readouterr().err
    assert re.search(rf"--resume: resuming {re.escape(str(run))} from step 2 \(step_0+2\)", err), err
    starts = json.loads((run / "meta.json").read_text())["starts"]
    final = run / "final" / "model.safetensors"
    mtime, logged = final.stat().st_mtime_ns, (run / "metrics.jsonl").read_text()
    # finished: said, exit 0, nothing loaded, written or evaluated
    assert cli(["train", "classify", "--out", str(run), "--resume"]) == 0
    out = capsys.readouterr().out
    metrics = json.loads((run / "final" / "metrics.json").read_text())
    assert f"--resume: {run} finished at step 3; nothing to resume or recompute" in out and "--reevaluate" in out
    assert f"top1={metrics['top1']:.4g}" in out
    assert final.stat().st_mtime_ns == mtime and (run / "metrics.jsonl").read_text() == logged
    assert json.loads((run / "meta.json").read_text())["starts"] == starts
    # --reevaluate: the final model is evaluated again (one more validation record at step 3)
    assert cli(["train", "classify", "--out", str(run), "--resume", "--reevaluate"]) == 0
    vals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    vals = [v for v in vals if v.get("split") == "val" and v["step"] == 3]
    assert len(vals) == 2 and vals[1]["top1"] == metrics["top1"]


_LIBRARY_NOISE = """
import sys, warnings
from lapheads.cli import quiet_libraries
quiet_libraries(verbose=sys.argv[2] == "verbose", interactive=False)
import transformers
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
model.save_pretrained(sys.argv[1])
transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
warnings.warn_explicit("a library's warning", RuntimeWarning, "lib.py", 1, module="scipy.stats")
warnings.warn_explicit("a lapheads warning", UserWarning, "ours.py", 1, module="lapheads.report")
"""


def test_library_progress_bars_and_warnings_stay_out_of_logs_unless_verbose(tmp_path):
    """A log file gets lapheads' own warnings but not transformers' "Loading weights" bar or a
    library's warning; ``--verbose`` (``LAPHEADS_VERBOSE=1`` for child processes) keeps them."""
    env = {k: v for k, v in os.environ.items() if k not in ("LAPHEADS_VERBOSE", *_QUIET_ENV)}
    logs = {}
    for mode in ("quiet", "verbose"):
        log = tmp_path / f"{mode}.log"
        with open(log, "w") as f:
            r = subprocess.run(
                [sys.executable, "-c", _LIBRARY_NOISE, str(tmp_path / mode), mode],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=300,
            )
        logs[mode] = log.read_text()
        assert r.returncode == 0, logs[mode]
        assert "a lapheads warning" in logs[mode]
    assert "Loading weights" in logs["verbose"] and "a library's warning" in logs["verbose"]
    assert "Loading weights" not in logs["quiet"] and "it/s" not in logs["quiet"]
    assert "a library's warning" not in logs["quiet"]


def test_verbose_flag_is_read_by_the_entry_and_handed_to_children(tmp_path):
    code = "import os, sys; from lapheads.cli import entry; sys.argv = ['lapheads', '--verbose', '--version']; entry(); print(os.environ.get('LAPHEADS_VERBOSE'), os.environ.get('TQDM_DISABLE'))"
    env = {k: v for k, v in os.environ.items() if k not in ("LAPHEADS_VERBOSE", *_QUIET_ENV)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.split()[-2:] == ["1", "None"], r.stdout + r.stderr
    r = subprocess.run(
        [sys.executable, "-c", code.replace("'--verbose', ", "")], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.stdout.split()[-2:] == ["None", "1"], r.stdout + r.stderr  # stderr is a pipe: quiet
