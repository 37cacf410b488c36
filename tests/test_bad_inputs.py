"""Bad-input sweep: malformed configs, CLI arguments, data sets, text/tokenizers and checkpoints.

Every case must give a non-zero exit, ONE line on stderr naming the file or field at fault and
what was expected (no traceback unless ``--debug``), and leave no partial output: the ``--out``
directory does not exist afterwards, or (for a run directory that existed) is byte-for-byte
unchanged.

Design choices:

* Cases are a table of ``(id, builder)``; a builder gets the shared fixtures and a scratch
  directory and returns the argv, the path that must stay untouched, and the words the error
  line must contain. Each case is its own test id, run in-process through ``lapheads.cli.main``.
* Shared, built once per module: a finished 2-step tiny classify run (checkpoint cases copy it),
  a small CIFAR archive, a small BPE tokenizer.
* One subprocess test checks the real console: exit status 2 and a one-line stderr, and with
  ``--debug`` a traceback.
* What needs a working directory of its own (``--overwrite`` of the current directory and its
  ancestors) is in tests/test_overwrite.py; an unreachable SLURM controller in
  tests/test_slurm_unreachable.py, sbatch refusing a job in tests/test_slurm.py.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from _reliability_helpers import DIGITS, TINY, classify_argv, snapshot, subprocess_env

from lapheads.cli import main as cli
from lapheads.errors import LapheadsError
from lapheads.recipes.shipped import CONFIG_DIR


@dataclass
class Case:
    argv: list[str]
    keep: Path  # must not exist afterwards, or be unchanged if it existed before
    needles: tuple[str, ...]
    rc: int = 2
    after: Callable[[], None] = field(default=lambda: None)  # extra checks (e.g. no code ran)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    base = tmp_path_factory.mktemp("shared")
    run = base / "run"
    assert (
        cli(
            classify_argv(
                run, "--set", "train.max_steps=2", "--set", "train.ckpt_every=1", "--set", "train.keep_checkpoints=3"
            )
        )
        == 0
    )
    from _data_writers import write_cifar_archive

    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 255, size=(20, 32, 32, 3), dtype=np.uint8)
    cifar = Path(
        write_cifar_archive(
            base / "cifar-10-python.tar.gz",
            imgs,
            np.arange(20) % 10,
            kind="cifar10",
            test_images=imgs[:10],
            test_labels=np.arange(10),
        )
    )
    from lapheads.lm.tokenizer import train_tokenizer

    tok = base / "tok"
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    train_tokenizer([" ".join(words[i:] + words[:i]) * 5 for i in range(len(words))], 300, str(tok))
    return {"run": run, "cifar": cifar, "tok": tok, "base": base}


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return path


# Cases that a regression would let train are kept to two steps.
SHORT = ("--set", "train.max_steps=2")


def _out(tmp: Path) -> Path:
    return tmp / "out"


def _train(tmp: Path, *extra: str) -> list[str]:
    return classify_argv(_out(tmp), *extra)


def _copy_run(s: dict, tmp: Path) -> Path:
    dst = tmp / "run"
    shutil.copytree(s["run"], dst)
    return dst


def _latest(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


def _only_latest(run: Path) -> Path:
    """Remove the checkpoints older than the newest, so that --resume has nothing to fall back to
    (a damaged newest checkpoint with an intact older one resumes from that one: tests/test_faults.py)."""
    for ck in (run / "checkpoints").glob("step_*"):
        if ck != _latest(run):
            shutil.rmtree(ck)
    return run


# ----------------------------------------------------------------------------- configs
def c_bad_yaml(s, tmp):
    cfg = _write(tmp / "bad.yaml", "model: [unclosed\ntrain: {")
    return Case(["train", "classify", "--config", str(cfg), "--out", str(_out(tmp))], _out(tmp), ("bad.yaml", "YAML"))


def c_missing_config(s, tmp):
    return Case(
        ["train", "classify", "--config", str(tmp / "nope.yaml"), "--out", str(_out(tmp))],
        _out(tmp),
        ("nope.yaml", "does not exist"),
    )


def c_yaml_not_mapping(s, tmp):
    cfg = _write(tmp / "list.yaml", "- a\n- b\n")
    return Case(
        ["train", "classify", "--config", str(cfg), "--out", str(_out(tmp))], _out(tmp), ("list.yaml", "mapping")
    )


def c_config_of_other_recipe(s, tmp):
    return Case(
        [
            "train",
            "classify",
            "--config",
            str(CONFIG_DIR / "lm/tiny.yaml"),
            "--out",
            str(_out(tmp)),
        ],
        _out(tmp),
        ("tiny.yaml", "'lm'", "'classify'"),
    )


def c_unknown_key(s, tmp):
    return Case(_train(tmp, "--set", "optim.lr_schedule=cosine"), _out(tmp), ("optim.lr_schedule", "allowed keys"))


def c_unknown_section(s, tmp):
    return Case(_train(tmp, "--set", "modle.depth=2"), _out(tmp), ("modle", "allowed keys"))


def c_unknown_key_in_yaml(s, tmp):
    text = Path(DIGITS).read_text().replace("  epochs: 20", "  epochs: 20\n  epohcs: 3")
    cfg = _write(tmp / "typo.yaml", text)
    return Case(
        ["train", "classify", "--config", str(cfg), "--out", str(_out(tmp)), *TINY], _out(tmp), ("data.epohcs",)
    )


def c_wrong_type_int(s, tmp):
    return Case(_train(tmp, "--set", "train.max_steps=abc"), _out(tmp), ("train.max_steps", "integer"))


def c_wrong_type_bool(s, tmp):
    return Case(_train(tmp, "--set", "train.progress=maybe"), _out(tmp), ("train.progress", "true or false"))


def c_wrong_type_section(s, tmp):
    return Case(_train(tmp, "--set", "optim=adamw"), _out(tmp), ("optim", "mapping"))


def c_bad_enum_schedule(s, tmp):
    return Case(_train(tmp, "--set", "train.schedule=exponential"), _out(tmp), ("train.schedule", "expected one of"))


def c_bad_enum_optimizer(s, tmp):
    return Case(_train(tmp, "--set", "optim.name=rmsprop"), _out(tmp), ("optim.name", "expected one of"))


def c_negative_max_steps(s, tmp):
    return Case(_train(tmp, "--set", "train.max_steps=-5"), _out(tmp), ("train.max_steps", ">= 0"))


def c_negative_batch_size(s, tmp):
    return Case(
        _train(tmp, "--set", "data.batch_size=-4", "--set", "train.max_steps=2"),
        _out(tmp),
        ("data.batch_size=-4", ">= 1"),
    )


def c_negative_lr(s, tmp):
    return Case(
        _train(tmp, "--set", "optim.lr=-1", "--set", "train.max_steps=2"), _out(tmp), ("optim", "learning rate", "-1")
    )


def c_lr_beyond_float32(s, tmp):
    return Case(
        _train(tmp, "--set", "optim.lr=1e39", "--set", "optim.lr_batch=0", "--set", "train.max_steps=2"),
        _out(tmp),
        ("learning rate 1e+39", "finite"),
    )


def c_ema_decay_out_of_range(s, tmp):
    return Case(_train(tmp, "--set", "train.ema_decay=1.5"), _out(tmp), ("train.ema_decay", "[0, 1)"))


def c_zero_length_run(s, tmp):
    return Case(_train(tmp, "--set", "data.epochs=0"), _out(tmp), ("data.epochs=0", ">= 1"))


def c_set_without_equals(s, tmp):
    return Case(_train(tmp, "--set", "train.max_steps"), _out(tmp), ("train.max_steps", "key=value"))


def c_tuple_wrong_length(s, tmp):
    return Case(_train(tmp, "--set", "optim.betas=[0.9]"), _out(tmp), ("optim.betas", "2 items"))


def c_too_many_laplacian_heads(s, tmp):
    return Case(_train(tmp, "--set", "model.laplacian_heads=3"), _out(tmp), ("laplacian_heads=3", "2 heads"))


def c_duplicate_key_in_yaml(s, tmp):
    # digits.yaml sets `laplacian_heads: all` under model:; plain YAML keeps the last, so this file
    # would silently train with every head Laplacian
    text = Path(DIGITS).read_text().replace("model:\n", "model:\n  laplacian_heads: 0\n", 1)
    cfg = _write(tmp / "dup.yaml", text)
    lines = [i + 1 for i, line in enumerate(text.splitlines()) if line.strip().startswith("laplacian_heads:")]
    return Case(
        ["train", "classify", "--config", str(cfg), "--out", str(_out(tmp)), *TINY, *SHORT],
        tmp,
        ("dup.yaml", "'model.laplacian_heads' is given twice", f"lines {lines[0]} and {lines[1]}"),
    )


def c_duplicate_section_in_yaml(s, tmp):
    text = Path(DIGITS).read_text()
    first = text.splitlines().index("model:") + 1
    second = len(text.splitlines()) + 2
    cfg = _write(tmp / "dup2.yaml", text + "\nmodel:\n  depth: 3\n")
    return Case(
        ["train", "classify", "--config", str(cfg), "--out", str(_out(tmp)), *TINY, *SHORT],
        tmp,
        ("dup2.yaml", "'model' is given twice", f"lines {first} and {second}"),
    )


def c_duplicate_key_in_set(s, tmp):
    return Case(
        _train(tmp, "--set", "model={depth: 2, depth: 3}", *SHORT), tmp, ("--set", "model.depth", "given twice")
    )


def c_config_is_a_directory(s, tmp):
    (tmp / "cfgdir.yaml").mkdir()
    return Case(
        ["train", "classify", "--config", str(tmp / "cfgdir.yaml"), "--out", str(_out(tmp))],
        tmp,
        ("cfgdir.yaml", "is a directory"),
    )


def c_clip_grad_nan(s, tmp):
    return Case(_train(tmp, "--set", "train.clip_grad=nan", *SHORT), tmp, ("train.clip_grad=nan", "finite"))


def c_lr_inf(s, tmp):
    return Case(_train(tmp, "--set", "optim.lr=.inf", *SHORT), tmp, ("optim.lr=inf", "finite"))


def c_seed_beyond_64_bits(s, tmp):
    return Case(_train(tmp, "--set", f"train.seed={2**70}", *SHORT), tmp, ("train.seed", "64 bits"))


def c_label_smoothing_out_of_range(s, tmp):
    return Case(_train(tmp, "--set", "aug.label_smoothing=5", *SHORT), tmp, ("aug.label_smoothing=5", "[0, 1)"))


def c_beta_out_of_range(s, tmp):
    return Case(_train(tmp, "--set", "optim.betas=[0.9,1.5]", *SHORT), tmp, ("optim.betas[1]=1.5", "[0, 1)"))


def c_model_extra_unknown_kwarg(s, tmp):
    return Case(_train(tmp, "--set", "model.extra.foo.bar=1", *SHORT), tmp, ("model", "'foo'", "model.extra"))


def c_model_extra_nan_text(s, tmp):
    # YAML reads `nan` as text: timm multiplied it by the width ('nannan...') and int() failed
    return Case(
        _train(tmp, "--set", "model.extra={mlp_ratio: nan}", *SHORT),
        tmp,
        ("model.extra.mlp_ratio='nan' (a string)", "vit_tiny_patch16_224", "remove the key"),
    )


def c_model_extra_nan(s, tmp):
    return Case(
        _train(tmp, "--set", "model.extra={mlp_ratio: .nan}", *SHORT), tmp, ("model.extra.mlp_ratio=nan", "finite")
    )


def c_model_extra_inf_nested(s, tmp):
    return Case(
        _train(tmp, "--set", "model.extra={foo: {bar: [1, -.inf]}}", *SHORT),
        tmp,
        ("model.extra.foo.bar[1]=-inf", "finite"),
    )


def c_model_extra_negative_size(s, tmp):
    return Case(
        _train(tmp, "--set", "model.extra={mlp_ratio: -2}", *SHORT),
        tmp,
        ("model.extra.mlp_ratio=-2", "negative dimension", "remove the key"),
    )


def c_model_extra_number_as_text(s, tmp):
    # '1' x 64 is a 64-digit number of features: torch's C++ error, whose frames must not show
    return Case(
        _train(tmp, "--set", "model.extra={mlp_ratio: '1'}", *SHORT),
        tmp,
        ("model.extra.mlp_ratio='1' (a string)", "Overflow"),
    )


def c_model_extra_names_the_one_key(s, tmp):
    return Case(
        _train(tmp, "--set", "model.extra={qkv_bias: false, mlp_ratio: -1, class_token: true}", *SHORT),
        tmp,
        ("model.extra.mlp_ratio=-1:",),
    )


def c_dino_kwargs_negative_size(s, tmp):
    return Case(
        ["train", "dino", "--config", "digits", "--out", str(_out(tmp)), "--set", "model.kwargs={mlp_ratio: -2}"],
        tmp,
        ("model.kwargs.mlp_ratio=-2", "negative dimension"),
    )


# ----------------------------------------------------------------------------- CLI arguments
def a_unknown_command(s, tmp):
    return Case(["frobnicate", "--out", str(_out(tmp))], _out(tmp), ("frobnicate", "unknown command"))


def a_group_without_subcommand(s, tmp):
    return Case(["train", "nonsense", "--out", str(_out(tmp))], _out(tmp), ("train", "needs one of", "classify"))


def a_missing_required_flag(s, tmp):
    return Case(["train", "classify", "--config", DIGITS], _out(tmp), ("--out", "required"))


def a_unknown_flag(s, tmp):
    return Case(_train(tmp, "--frobnicate"), _out(tmp), ("--frobnicate",))


def a_flag_wrong_type(s, tmp):
    return Case(
        ["tokenizer", "train", "--embedded", "--vocab-size", "many", "--out", str(_out(tmp))],
        _out(tmp),
        ("--vocab-size", "many"),
    )


def a_resume_and_overwrite(s, tmp):
    run = _copy_run(s, tmp)
    return Case(
        classify_argv(
            run,
            "--set",
            "train.max_steps=2",
            "--set",
            "train.ckpt_every=1",
            "--set",
            "train.keep_checkpoints=3",
            "--resume",
            "--overwrite",
        ),
        run,
        ("--resume", "--overwrite"),
    )


def a_resume_missing_run(s, tmp):
    return Case(_train(tmp, "--resume"), _out(tmp), (str(_out(tmp)), "not a run directory"))


def a_resume_empty_dir_without_config(s, tmp):
    # without --config the recipe's defaults (not digits) would start a new run there without a word
    _out(tmp).mkdir()
    return Case(
        ["train", "classify", "--out", str(_out(tmp)), "--resume"],
        _out(tmp),
        (str(_out(tmp)), "not a run directory", "--config"),
    )


def a_resume_missing_dir_without_config(s, tmp):
    return Case(["train", "classify", "--out", str(_out(tmp)), "--resume"], _out(tmp), ("not a run directory",))


def _sweep(tmp: Path, *extra: str) -> list[str]:
    return ["sweep", "--config", "classify/digits", "--out", str(_out(tmp)), *TINY, *SHORT, "--no-report", *extra]


def a_sweep_duplicate_seeds(s, tmp):
    return Case(_sweep(tmp, "--laplacian-heads", "0", "--seeds", "0,1,0"), tmp, ("--seeds '0,1,0'", "seed 0 twice"))


def a_sweep_two_spellings_of_no_heads(s, tmp):
    return Case(
        _sweep(tmp, "--laplacian-heads", "0,none", "--seeds", "0"),
        tmp,
        ("--laplacian-heads", "'0' and 'none' are the same setting"),
    )


def a_sweep_two_spellings_of_k(s, tmp):
    return Case(_sweep(tmp, "--laplacian-heads", "1,all,01"), tmp, ("'1' and '01' are the same setting",))


def a_sbatch_without_equals(s, tmp):
    return Case(
        _train(tmp, "--launcher", "slurm", "--sbatch", "noequals", "--no-wait"),
        tmp,
        ("--sbatch 'noequals'", "KEY=VALUE", "exclusive="),
    )


def a_sweep_sbatch_bad_key(s, tmp):
    return Case(
        _sweep(tmp, "--launcher", "slurm", "--sbatch", "qos high=1", "--no-wait"),
        tmp,
        ("--sbatch 'qos high=1'", "KEY=VALUE"),
    )


def a_existing_run_without_resume(s, tmp):
    run = _copy_run(s, tmp)
    return Case(classify_argv(run, "--set", "train.max_steps=2"), run, (str(run), "--resume", "--overwrite"))


# ----------------------------------------------------------------------------- output paths
# "Unwritable": the tests run as root, whom permission bits do not stop, so the unwritable place
# is sysfs (/sys refuses new entries even to root); a path under a regular file cannot exist.
def _afile(tmp: Path) -> Path:
    return _write(tmp / "afile", "not a directory\n")


def o_overwrite_dir_holding_the_config(s, tmp):
    # the --config being read and the user's notes live in --out: --overwrite would delete both
    d = tmp / "d"
    shutil.copy(DIGITS, _write(d / "notes.txt", "mine").parent / "my.yaml")
    return Case(
        ["train", "classify", "--config", str(d / "my.yaml"), "--out", str(d), "--overwrite", *TINY, *SHORT],
        tmp,
        ("--overwrite would delete", "my.yaml", "which this command reads"),
    )


def o_overwrite_run_with_a_file_of_the_user(s, tmp):
    run = _copy_run(s, tmp)
    _write(run / "notes.txt", "mine")
    return Case(
        classify_argv(run, *SHORT, "--overwrite"), tmp, ("--overwrite refuses", "notes.txt", "not one of the run's own")
    )


def o_overwrite_not_a_run(s, tmp):
    _write(_out(tmp) / "thesis.tex", "\\section{}")
    return Case(_train(tmp, *SHORT, "--overwrite"), tmp, ("--overwrite refuses", "not a run directory"))


def o_train_out_is_file(s, tmp):
    return Case(classify_argv(_afile(tmp), *SHORT), tmp, ("--out", "afile", "existing file"))


def o_train_out_under_file(s, tmp):
    return Case(classify_argv(_afile(tmp) / "sub", *SHORT), tmp, ("--out", "afile/sub", "afile is a file"))


def o_train_out_unwritable(s, tmp):
    out = Path("/sys/lapheads_bad_inputs_out")
    if not Path("/sys").is_dir():
        pytest.skip("no /sys here")
    return Case(classify_argv(out, *SHORT), out, ("--out", str(out), "not writable"))


def o_report_out_is_file(s, tmp):
    return Case(["report", str(s["run"]), "--out", str(_afile(tmp))], tmp, ("--out", "afile", "existing file"))


def o_report_out_under_file(s, tmp):
    return Case(["report", str(s["run"]), "--out", str(_afile(tmp) / "rep")], tmp, ("afile/rep", "afile is a file"))


def o_tokenize_out_is_file(s, tmp):
    f = _write(tmp / "a.txt", "some text " * 50)
    return Case(
        ["data", "tokenize", "--input", str(f), "--tokenizer", str(s["tok"]), "--out", str(_afile(tmp))],
        tmp,
        ("--out", "afile", "existing file"),
    )


def o_tokenizer_train_out_under_file(s, tmp):
    return Case(
        ["tokenizer", "train", "--embedded", "--vocab-size", "300", "--out", str(_afile(tmp) / "tok")],
        tmp,
        ("--out", "afile/tok", "afile is a file"),
    )


def o_eval_classify_out_is_dir(s, tmp):
    run = _copy_run(s, tmp)
    (tmp / "res").mkdir()
    return Case(
        ["eval", "classify", "--checkpoint", str(run), "--out", str(tmp / "res")],
        tmp,
        ("--out", "res", "is a directory"),
    )


def o_eval_lm_out_is_dir_before_loading(s, tmp):
    # checked before the model: the run named here does not even exist
    (tmp / "res").mkdir()
    arc = _write(
        tmp / "arc.jsonl",
        json.dumps(
            {"id": "q", "question": "Which?", "answerKey": "A", "choices": {"text": ["a", "b"], "label": ["A", "B"]}}
        )
        + "\n",
    )
    return Case(
        ["eval", "lm", "--run", str(tmp / "no_run"), "--tasks", f"arc_easy={arc}", "--out", str(tmp / "res")],
        tmp,
        ("--out", "res", "is a directory"),
    )


def o_eval_lm_include_missing_before_loading(s, tmp):
    return Case(
        [
            "eval",
            "lm",
            "--run",
            str(tmp / "no_run"),
            "--lm-eval",
            "some_task",
            "--lm-eval-include",
            str(tmp / "no_tasks"),
        ],
        tmp,
        ("--lm-eval-include", "no_tasks", "does not exist"),
    )


def o_eval_lm_task_file_is_dir(s, tmp):
    (tmp / "arc_dir").mkdir()
    return Case(
        ["eval", "lm", "--run", str(tmp / "no_run"), "--tasks", f"arc_easy={tmp / 'arc_dir'}"],
        tmp,
        ("arc_dir", "is a directory"),
    )


def a_sample_temperature_nan(s, tmp):
    # flags are checked while the command line is parsed: the run named here does not even exist
    return Case(
        ["sample", "--run", str(tmp / "no_run"), "--prompt", "x", "--temperature", "nan"],
        tmp,
        ("--temperature", "'nan'", "finite"),
    )


def a_eval_lm_seed_beyond_64_bits(s, tmp):
    return Case(
        ["eval", "lm", "--run", str(tmp / "no_run"), "--tasks", "humaneval", "--seed", str(2**64)],
        tmp,
        ("--seed", "18446744073709551616", "64 bits"),
    )


def a_tokenize_val_fraction_out_of_range(s, tmp):
    f = _write(tmp / "a.txt", "some text " * 50)
    return Case(
        [
            "data",
            "tokenize",
            "--input",
            str(f),
            "--tokenizer",
            str(s["tok"]),
            "--out",
            str(_out(tmp)),
            "--val-fraction",
            "1.5",
        ],
        tmp,
        ("--val-fraction", "1.5", "[0, 1)"),
    )


def o_analyze_out_is_file(s, tmp):
    return Case(
        ["analyze", "--run", str(s["run"]), "--out", str(_afile(tmp))], tmp, ("--out", "afile", "existing file")
    )


def o_pca_maps_out_is_dir(s, tmp):
    (tmp / "maps.png").mkdir()
    return Case(
        ["pca-maps", "--model", "vit_tiny_patch16_224", "--images", "digits", "--out", str(tmp / "maps.png")],
        tmp,
        ("--out", "maps.png", "is a directory"),
    )


# ----------------------------------------------------------------------------- failures clean up
def f_tokenize_empty_corpus_leaves_no_folder(s, tmp):
    f = _write(tmp / "blank.jsonl", '{"text": ""}\n{"text": ""}\n')
    return Case(
        ["data", "tokenize", "--input", str(f), "--tokenizer", str(s["tok"]), "--out", str(_out(tmp)), "--no-progress"],
        _out(tmp),
        ("blank.jsonl", "empty"),
    )


def f_report_corrupt_model_json_leaves_no_figures(s, tmp):
    run = _copy_run(s, tmp)
    (run / "final" / "model.json").write_text('{"model": {"name": ')  # a torn write
    return Case(["report", str(run), "--out", str(_out(tmp))], _out(tmp), ("final/model.json", "not valid JSON"))


def f_report_into_existing_dir_adds_nothing(s, tmp):
    run = _copy_run(s, tmp)
    (run / "final" / "model.json").write_text("[]")
    out = _write(_out(tmp) / "notes.md", "kept\n").parent
    return Case(["report", str(run), "--out", str(out)], out, ("final/model.json", "must be an object"))


# ----------------------------------------------------------------------------- image data
def d_truncated_cifar(s, tmp):
    raw = s["cifar"].read_bytes()
    bad = _write(tmp / "trunc.tar.gz", raw[: len(raw) // 2])
    return Case(_train(tmp, "--set", f"data.train={bad}"), _out(tmp), ("trunc.tar.gz",))


def d_corrupt_cifar(s, tmp):
    bad = _write(tmp / "junk.tar.gz", b"definitely not a tar archive" * 20)
    return Case(_train(tmp, "--set", f"data.train={bad}"), _out(tmp), ("junk.tar.gz",))


def d_idx_wrong_magic(s, tmp):
    from _data_writers import write_idx

    root = tmp / "mnist"
    root.mkdir()
    imgs = np.zeros((8, 8, 8), dtype=np.uint8)
    for prefix in ("train", "t10k"):
        write_idx(root / f"{prefix}-images-idx3-ubyte", imgs)
        write_idx(root / f"{prefix}-labels-idx1-ubyte", (np.arange(8) % 2).astype(np.uint8))
    p = root / "train-images-idx3-ubyte"
    p.write_bytes(b"\x12\x34\x08\x03" + p.read_bytes()[4:])
    return Case(_train(tmp, "--set", f"data.train={root}"), _out(tmp), ("train-images-idx3-ubyte", "magic"))


def d_empty_imagefolder(s, tmp):
    root = tmp / "empty_folder"
    (root / "train").mkdir(parents=True)
    (root / "val").mkdir()
    return Case(_train(tmp, "--set", f"data.train={root}"), _out(tmp), ("empty_folder",))


def _folder(tmp: Path) -> Path:
    from PIL import Image

    root = tmp / "folder"
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            (root / split / c).mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(root / split / c / f"{i}.png")
    return root


def d_undecodable_image(s, tmp):
    root = _folder(tmp)
    _write(root / "train" / "dog" / "broken.png", b"\x89PNG\r\n\x1a\n this is not image data")
    return Case(_train(tmp, "--set", f"data.train={root}"), _out(tmp), ("broken.png",))


def d_val_classes_differ(s, tmp):
    root = _folder(tmp)
    shutil.rmtree(root / "val" / "dog")
    return Case(_train(tmp, "--set", f"data.train={root}"), _out(tmp), ("dog",))


def d_labels_out_of_range(s, tmp):
    from _data_writers import write_cifar_archive

    imgs = np.zeros((8, 32, 32, 3), dtype=np.uint8)
    bad = write_cifar_archive(
        tmp / "badlabels.tar.gz",
        imgs,
        np.array([0, 1, 2, 3, 4, 5, 6, 12]),
        kind="cifar10",
        test_images=imgs[:2],
        test_labels=np.array([0, 1]),
    )
    return Case(_train(tmp, "--set", f"data.train={bad}"), _out(tmp), ("12", "out of range"))


def d_hf_image_column_of_strings(s, tmp):
    import datasets

    saved = tmp / "hf_strings"
    ds = datasets.Dataset.from_dict({"image": [f"img_{i}.png" for i in range(20)], "label": [i % 2 for i in range(20)]})
    ds.save_to_disk(str(saved))
    return Case(
        _train(tmp, "--set", f"data.train=hf:{saved}", *SHORT),
        _out(tmp),
        ("hf_strings", "row 0 of column 'image' is not an image", "str"),
    )


def d_missing_path(s, tmp):
    return Case(_train(tmp, "--set", f"data.train={tmp / 'no_such_dataset'}"), _out(tmp), ("no_such_dataset",))


# ----------------------------------------------------------------------------- text and tokenizers
def t_empty_corpus(s, tmp):
    f = _write(tmp / "empty.txt", "")
    return Case(
        ["tokenizer", "train", "--input", str(f), "--vocab-size", "300", "--out", str(_out(tmp))],
        _out(tmp),
        ("empty.txt", "empty"),
    )


def t_parquet_without_text_column(s, tmp):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp / "no_text.parquet"
    pq.write_table(pa.table({"body": ["hello world", "more text"]}), f)
    return Case(
        ["tokenizer", "train", "--input", str(f), "--vocab-size", "300", "--out", str(_out(tmp))],
        _out(tmp),
        ("no_text.parquet", "text"),
    )


def t_jsonl_not_json(s, tmp):
    f = _write(tmp / "bad.jsonl", 'this is not json\n{"text": "ok"}\n')
    return Case(
        ["tokenizer", "train", "--input", str(f), "--vocab-size", "300", "--out", str(_out(tmp))],
        _out(tmp),
        ("bad.jsonl", "1"),
    )


def t_vocab_too_small(s, tmp):
    f = _write(tmp / "a.txt", "some text " * 50)
    return Case(
        ["tokenizer", "train", "--input", str(f), "--vocab-size", "10", "--out", str(_out(tmp))],
        _out(tmp),
        ("vocab", "10"),
    )


def t_tokenizer_dir_missing_files(s, tmp):
    (tmp / "tok_empty").mkdir()
    f = _write(tmp / "a.txt", "some text " * 50)
    return Case(
        ["data", "tokenize", "--input", str(f), "--tokenizer", str(tmp / "tok_empty"), "--out", str(_out(tmp))],
        _out(tmp),
        ("tok_empty", "tokenizer.json"),
    )


def t_tokenizer_json_corrupt(s, tmp):
    tok = tmp / "tok_bad"
    shutil.copytree(s["tok"], tok)
    (tok / "tokenizer.json").write_text("{ not json")
    f = _write(tmp / "a.txt", "some text " * 50)
    return Case(
        ["data", "tokenize", "--input", str(f), "--tokenizer", str(tok), "--out", str(_out(tmp))],
        _out(tmp),
        ("tokenizer.json",),
    )


def t_tokenize_missing_input(s, tmp):
    return Case(
        ["data", "tokenize", "--input", str(tmp / "gone.txt"), "--tokenizer", str(s["tok"]), "--out", str(_out(tmp))],
        _out(tmp),
        ("gone.txt", "no such file"),
    )


def t_lm_missing_corpus(s, tmp):
    return Case(
        [
            "train",
            "lm",
            "--config",
            str(CONFIG_DIR / "lm/tiny.yaml"),
            "--out",
            str(_out(tmp)),
            "--set",
            f"data.corpus={tmp / 'corpus_gone.txt'}",
            "--set",
            f"data.tokenizer={s['tok']}",
        ],
        _out(tmp),
        ("corpus_gone.txt",),
    )


def t_lm_tokenizer_dir_missing_files(s, tmp):
    (tmp / "tok_empty").mkdir()
    f = _write(tmp / "a.txt", "some text " * 50)
    return Case(
        [
            "train",
            "lm",
            "--config",
            str(CONFIG_DIR / "lm/tiny.yaml"),
            "--out",
            str(_out(tmp)),
            "--set",
            f"data.corpus={f}",
            "--set",
            f"data.tokenizer={tmp / 'tok_empty'}",
        ],
        _out(tmp),
        ("tok_empty", "tokenizer.json"),
    )


def t_sft_messages_not_a_list(s, tmp):
    f = _write(
        tmp / "chat.jsonl",
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" + json.dumps({"messages": "hello"}) + "\n",
    )
    return Case(
        [
            "train",
            "sft",
            "--config",
            str(CONFIG_DIR / "sft/tiny.yaml"),
            "--out",
            str(_out(tmp)),
            "--set",
            f"init_from={tmp / 'lm_run'}",
            "--set",
            f"data.sources=[{{path: {f}, weight: 1.0}}]",
        ],
        _out(tmp),
        ("chat.jsonl:2", "messages"),
    )


def t_sft_unknown_role(s, tmp):
    f = _write(tmp / "chat.jsonl", json.dumps({"messages": [{"role": "robot", "content": "beep"}]}) + "\n")
    return Case(
        [
            "train",
            "sft",
            "--config",
            str(CONFIG_DIR / "sft/tiny.yaml"),
            "--out",
            str(_out(tmp)),
            "--set",
            f"init_from={tmp / 'lm_run'}",
            "--set",
            f"data.sources=[{{path: {f}, weight: 1.0}}]",
        ],
        _out(tmp),
        ("chat.jsonl:1", "unknown role 'robot'"),
    )


def t_sft_chat_not_json(s, tmp):
    f = _write(tmp / "chat.jsonl", '{"messages": [\n')
    return Case(
        [
            "train",
            "sft",
            "--config",
            str(CONFIG_DIR / "sft/tiny.yaml"),
            "--out",
            str(_out(tmp)),
            "--set",
            f"init_from={tmp / 'lm_run'}",
            "--set",
            f"data.sources=[{{path: {f}, weight: 1.0}}]",
        ],
        _out(tmp),
        ("chat.jsonl", "1"),
    )


# ----------------------------------------------------------------------------- checkpoints
MARKER = Path("/tmp/lapheads_bad_inputs_pwned")


class _Evil:
    def __reduce__(self):
        return (Path.touch, (MARKER,))


def _resume(run: Path) -> list[str]:
    return classify_argv(
        run,
        "--set",
        "train.max_steps=2",
        "--set",
        "train.ckpt_every=1",
        "--set",
        "train.keep_checkpoints=3",
        "--resume",
        "--reevaluate",  # the run has finished: without it nothing would be loaded
    )


def k_pickle_payload(s, tmp):
    run = _only_latest(_copy_run(s, tmp))
    MARKER.unlink(missing_ok=True)
    with open(_latest(run) / "state.pt", "wb") as f:
        pickle.dump({"step": _Evil()}, f)

    def no_code_ran():
        assert not MARKER.exists(), "the pickle payload was executed"

    return Case(_resume(run), run, ("state.pt", "weights_only", "Unsupported", "could run code"), after=no_code_ran)


def k_truncated_safetensors(s, tmp):
    run = _only_latest(_copy_run(s, tmp))
    p = _latest(run) / "model.safetensors"
    p.write_bytes(p.read_bytes()[:100])
    return Case(_resume(run), run, ("model.safetensors", "safetensors"))


def k_truncated_state(s, tmp):
    run = _only_latest(_copy_run(s, tmp))
    p = _latest(run) / "state.pt"
    p.write_bytes(p.read_bytes()[:50])
    return Case(_resume(run), run, ("state.pt",))


def k_latest_points_nowhere(s, tmp):
    run = _copy_run(s, tmp)
    for ck in (run / "checkpoints").glob("step_*"):  # an intact one would be resumed from instead
        shutil.rmtree(ck)
    (run / "checkpoints" / "latest").write_text("step_99999999")
    return Case(_resume(run), run, ("latest", "step_99999999"))


def k_resume_other_architecture(s, tmp):
    run = _copy_run(s, tmp)
    return Case(_resume(run) + ["--set", "model.depth=3"], run, ("model.depth", "2", "3", "config.yaml"))


def k_checkpoint_of_other_architecture(s, tmp):
    # the config check passes (config.yaml edited too), the weights do not fit: keys are listed
    run = _copy_run(s, tmp)
    cfg = run / "config.yaml"
    cfg.write_text(cfg.read_text().replace("depth: 2", "depth: 3"))
    return Case(_resume(run) + ["--set", "model.depth=3"], run, ("model.safetensors", "missing keys", "blocks.2."))


def k_eval_other_architecture(s, tmp):
    run = _copy_run(s, tmp)
    spec_path = run / "final" / "model.json"
    spec = json.loads(spec_path.read_text())
    spec["model"]["embed_dim"] = 48
    spec_path.write_text(json.dumps(spec))
    return Case(
        ["eval", "classify", "--checkpoint", str(run)],
        run,
        ("final/model.safetensors", "shape mismatches", "(32,) vs model (48,)"),
    )


def k_eval_truncated_final(s, tmp):
    run = _copy_run(s, tmp)
    p = run / "final" / "model.safetensors"
    p.write_bytes(p.read_bytes()[:64])
    return Case(["eval", "classify", "--checkpoint", str(run)], run, ("final/model.safetensors",))


def k_eval_not_a_run(s, tmp):
    (tmp / "not_a_run").mkdir()
    return Case(
        ["eval", "classify", "--checkpoint", str(tmp / "not_a_run")], tmp / "not_a_run", ("not_a_run", "config.yaml")
    )


def k_knn_corrupt_model_json(s, tmp):
    run = _copy_run(s, tmp)
    (run / "final" / "model.json").write_text('{"timm_name": "vit_')
    return Case(["eval", "knn", "--run", str(run), "--data", "digits"], run, ("final/model.json", "not valid JSON"))


def k_eval_corrupt_model_json(s, tmp):
    run = _copy_run(s, tmp)
    (run / "final" / "model.json").write_bytes(b"\x00\x13 garbage")
    return Case(["eval", "classify", "--checkpoint", str(run)], run, ("final/model.json", "not valid JSON"))


CASES = {
    f.__name__: f
    for f in [
        c_bad_yaml,
        c_missing_config,
        c_yaml_not_mapping,
        c_config_of_other_recipe,
        c_unknown_key,
        c_unknown_section,
        c_unknown_key_in_yaml,
        c_wrong_type_int,
        c_wrong_type_bool,
        c_wrong_type_section,
        c_bad_enum_schedule,
        c_bad_enum_optimizer,
        c_negative_max_steps,
        c_negative_batch_size,
        c_negative_lr,
        c_lr_beyond_float32,
        c_ema_decay_out_of_range,
        c_zero_length_run,
        c_set_without_equals,
        c_tuple_wrong_length,
        c_too_many_laplacian_heads,
        c_duplicate_key_in_yaml,
        c_duplicate_section_in_yaml,
        c_duplicate_key_in_set,
        c_config_is_a_directory,
        c_clip_grad_nan,
        c_lr_inf,
        c_seed_beyond_64_bits,
        c_label_smoothing_out_of_range,
        c_beta_out_of_range,
        c_model_extra_unknown_kwarg,
        c_model_extra_nan_text,
        c_model_extra_nan,
        c_model_extra_inf_nested,
        c_model_extra_negative_size,
        c_model_extra_number_as_text,
        c_model_extra_names_the_one_key,
        c_dino_kwargs_negative_size,
        a_unknown_command,
        a_group_without_subcommand,
        a_missing_required_flag,
        a_unknown_flag,
        a_flag_wrong_type,
        a_resume_and_overwrite,
        a_resume_missing_run,
        a_resume_empty_dir_without_config,
        a_resume_missing_dir_without_config,
        a_sweep_duplicate_seeds,
        a_sweep_two_spellings_of_no_heads,
        a_sweep_two_spellings_of_k,
        a_sbatch_without_equals,
        a_sweep_sbatch_bad_key,
        a_existing_run_without_resume,
        o_overwrite_dir_holding_the_config,
        o_overwrite_run_with_a_file_of_the_user,
        o_overwrite_not_a_run,
        o_train_out_is_file,
        o_train_out_under_file,
        o_train_out_unwritable,
        o_report_out_is_file,
        o_report_out_under_file,
        o_tokenize_out_is_file,
        o_tokenizer_train_out_under_file,
        o_eval_classify_out_is_dir,
        o_eval_lm_out_is_dir_before_loading,
        o_eval_lm_include_missing_before_loading,
        o_eval_lm_task_file_is_dir,
        o_analyze_out_is_file,
        o_pca_maps_out_is_dir,
        a_sample_temperature_nan,
        a_eval_lm_seed_beyond_64_bits,
        a_tokenize_val_fraction_out_of_range,
        f_tokenize_empty_corpus_leaves_no_folder,
        f_report_corrupt_model_json_leaves_no_figures,
        f_report_into_existing_dir_adds_nothing,
        d_truncated_cifar,
        d_corrupt_cifar,
        d_idx_wrong_magic,
        d_empty_imagefolder,
        d_undecodable_image,
        d_val_classes_differ,
        d_labels_out_of_range,
        d_missing_path,
        d_hf_image_column_of_strings,
        t_empty_corpus,
        t_parquet_without_text_column,
        t_jsonl_not_json,
        t_vocab_too_small,
        t_tokenizer_dir_missing_files,
        t_tokenizer_json_corrupt,
        t_tokenize_missing_input,
        t_lm_missing_corpus,
        t_lm_tokenizer_dir_missing_files,
        t_sft_messages_not_a_list,
        t_sft_unknown_role,
        t_sft_chat_not_json,
        k_pickle_payload,
        k_truncated_safetensors,
        k_truncated_state,
        k_latest_points_nowhere,
        k_resume_other_architecture,
        k_checkpoint_of_other_architecture,
        k_eval_other_architecture,
        k_eval_truncated_final,
        k_eval_not_a_run,
        k_eval_corrupt_model_json,
        k_knn_corrupt_model_json,
    ]
}


# Known product gaps (recipes this file does not own): strict, so a fix makes them fail loudly.
KNOWN: dict[str, str] = {}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN[n], strict=True)) if n in KNOWN else n for n in CASES]
)
def test_bad_input_is_one_clear_line_and_leaves_nothing(name, shared, tmp_path, capsys):
    case = CASES[name](shared, tmp_path)
    before = snapshot(case.keep)
    capsys.readouterr()
    rc = cli(case.argv)
    out, err = capsys.readouterr()
    assert rc == case.rc, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("lapheads"), err
    for needle in case.needles:
        assert needle in lines[0], (needle, lines[0])
    assert snapshot(case.keep) == before, f"{case.keep} was created or changed by a failed command"
    case.after()


@pytest.mark.parametrize(
    "name", ["c_wrong_type_int", "d_corrupt_cifar", "k_truncated_safetensors", "a_missing_required_flag"]
)
def test_debug_shows_the_traceback(name, shared, tmp_path):
    case = CASES[name](shared, tmp_path)
    with pytest.raises(LapheadsError):
        cli(case.argv + ["--debug"])


@pytest.mark.slow
def test_console_exit_code_and_stderr(shared, tmp_path):
    """The real console: status 2 and exactly one stderr line (no library warning either, here a
    refused pickle payload); with --debug the error itself is raised (the interpreter prints its
    traceback; checked in this process, a second console would only add ~5 s of imports)."""
    case = k_pickle_payload(shared, tmp_path)
    before = snapshot(case.keep)
    r = subprocess.run(
        [sys.executable, "-m", "lapheads.cli", *case.argv],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lapheads train classify: error: "), r.stderr
    assert "state.pt was refused by the safe loader" in lines[0] and "could run code" in lines[0], r.stderr
    assert snapshot(case.keep) == before
    case.after()
    out = tmp_path / "out"
    with pytest.raises(LapheadsError, match=r"^train\.schedule='exp' is not allowed") as e:
        cli([*classify_argv(out, "--set", "train.schedule=exp"), "--debug"])
    assert type(e.value).__name__ == "ConfigError"
    assert not out.exists()


@pytest.mark.slow  # lm-eval indexes its ~10k built-in task files (10-60 s on 2 cores)
def test_eval_lm_checks_lm_eval_task_names_before_loading_the_model(tmp_path, capsys, monkeypatch):
    from _lm_helpers import offline

    import lapheads.recipes.lm as lm_recipe

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the lm-eval task names were checked")

    monkeypatch.setattr(lm_recipe, "load_model", no_load)
    offline(monkeypatch, tmp_path / "hf_datasets")
    (tmp_path / "tasks").mkdir()
    rc = cli(
        [
            "eval",
            "lm",
            "--run",
            str(tmp_path / "run"),
            "--lm-eval",
            "no_such_task_xyz",
            "--lm-eval-include",
            str(tmp_path / "tasks"),
            "--out",
            str(tmp_path / "eval.json"),
        ]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "no_such_task_xyz" in lines[0] and "not found" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tasks"]
