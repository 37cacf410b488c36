"""``train.trackers``: W&B (offline) and MLflow (its default store, a file store) on a tiny classify
run and its resume; the users' ``WANDB_*`` / ``MLFLOW_*`` variables; what is refused before training.

What the trackers received is read back from what they wrote: MLflow through its client, W&B
from the ``.wandb`` record log of each offline run (a LevelDB-style log of protobuf records,
parsed here: the SDK has no public reader of offline runs). Both must equal ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
from test_classify import DIGITS, TINY

from lapheads.cli import main as cli
from lapheads.engine.trackers import check_trackers
from lapheads.engine.trainer import TrainConfig
from lapheads.errors import ConfigError

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")


def _wandb_records(path: Path):
    """The protobuf records of a ``run-<id>.wandb`` file (W&B's LevelDB-style log: 32 KiB blocks,
    7-byte record headers, records split FIRST / MIDDLE / LAST across blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B"
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and n == 0:
            pos += left - 7
            continue
        buf += data[pos : pos + n]
        pos += n
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def _wandb_run(root: Path) -> list[dict]:
    """Each offline W&B run under ``root/wandb``, in order: its folder, run id, project, name, tags,
    config, history rows and the number of system-metrics (``stats``) records."""
    out = []
    for d in sorted((root / "wandb").glob("offline-run-*")):
        run: dict = {"dir": d, "history": [], "stats": 0}
        for rec in _wandb_records(next(d.glob("run-*.wandb"))):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run.update(id=rec.run.run_id, project=rec.run.project, name=rec.run.display_name)
                run.update(tags=list(rec.run.tags))
                run["config"] = {i.key: json.loads(i.value_json) for i in rec.run.config.update}
            elif kind == "history":
                run["history"].append(
                    {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                )
            elif kind == "stats":
                run["stats"] += 1
        out.append(run)
    return out


@pytest.fixture(autouse=True)
def _no_tracker_settings(monkeypatch, tmp_path):
    """Each test starts without the user's W&B / MLflow variables, in its own working directory
    (where MLflow's default store, ``sqlite:///mlflow.db``, is made)."""
    import os

    for key in list(os.environ):
        if key.startswith(("WANDB_", "MLFLOW_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)


def _train(out: Path, *extra: str, trackers: str = "tensorboard,wandb,mlflow") -> int:
    return cli(
        [
            "train",
            "classify",
            "--config",
            DIGITS,
            "--out",
            str(out),
            *TINY,
            "--set",
            "train.eval_every=2",
            "--set",
            "train.ckpt_every=2",
            "--set",
            "data.max_eval_items=32",
            "--set",
            "model.laplacian_heads=learn",
            "--set",
            f"train.trackers=[{trackers}]",
            *extra,
        ]
    )


def _one_line_refusal(capsys, rc: int, out: Path) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert not (out / "config.yaml").exists()  # refused before the run was made
    return err


def test_wandb_offline_and_mlflow_receive_config_metrics_mixing_and_figures_and_resume_continues(
    tmp_path, monkeypatch, capsys
):
    """MLflow's default store (nothing set: sqlite:///mlflow.db in the working directory) and W&B
    offline under WANDB_DIR, with WANDB_PROJECT / WANDB_NAME / WANDB_CONSOLE set by the user."""
    wandb_home = tmp_path / "wandb-home"
    monkeypatch.setenv("WANDB_DIR", str(wandb_home))  # not made yet: W&B's files go there, made by the run
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_NAME", "named-by-env")
    monkeypatch.setenv("WANDB_TAGS", "from-env,second")
    monkeypatch.setenv("WANDB_X_DISABLE_STATS", "false")  # lapheads' default is true (no system metrics)
    monkeypatch.setenv("WANDB_X_STATS_SAMPLING_INTERVAL", "0.1")
    out = tmp_path / "run"
    assert _train(out, "--set", "train.max_steps=4") == 0
    ids = json.loads((out / "trackers.json").read_text())
    assert _train(out, "--set", "train.max_steps=6", "--resume") == 0
    assert json.loads((out / "trackers.json").read_text()) == ids  # the same tracker runs continued
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "split" not in r]
    val = [r for r in records if r.get("split") == "val"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6] and [r["step"] for r in val] == [2, 4, 6]
    assert (out / "tb").is_dir()  # tensorboard as before

    # MLflow: one run in MLflow's default store, read back through its client
    from mlflow.tracking import MlflowClient

    store = tmp_path / "mlflow.db"
    assert store.is_file() and ids["mlflow"]["tracking_uri"] == f"sqlite:///{store}"
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    run_id = ids["mlflow"]["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["model.laplacian_heads"] == "learn"
    assert client.get_experiment(run.info.experiment_id).name == "lapheads"  # MLflow's: no variable set
    assert run.info.run_name == "run"
    for split, rows in (("train", train), ("val", val)):
        for key in ("loss", "lr", "grad_norm") if split == "train" else ("top1", "loss"):
            hist = sorted((m.step, m.value) for m in client.get_metric_history(run_id, f"{split}/{key}"))
            assert hist == [(r["step"], r[key]) for r in rows], key
    arts = {a.path for d in ("", "final", "report", "lap_mix") for a in client.list_artifacts(run_id, d or None)}
    assert {"config.json", "final/metrics.json", "report/classify_mixing.png", "report/classify_curves.png"} <= arts
    mix_files = sorted(a for a in arts if a.startswith("lap_mix/"))
    assert len(mix_files) == 3
    mix = json.loads(Path(client.download_artifacts(run_id, mix_files[-1], str(tmp_path / "dl"))).read_text())
    last = val[-1]["lap_mix"]
    assert mix["columns"] == ["layer", "head", "a", "b", "laplacianness"]
    assert mix["rows"] == [
        [row["layer"], h, a, b, ln]
        for row in last
        for h, (a, b, ln) in enumerate(zip(row["a"], row["b"], row["laplacianness"]))
    ]

    # W&B: two offline attempts of one run id under WANDB_DIR; their history together equals metrics.jsonl
    assert not (out / "wandb").exists()
    runs = _wandb_run(wandb_home)
    assert len(runs) == 2 and {r["id"] for r in runs} == {ids["wandb"]["run_id"]}
    assert {(r["project"], r["name"], tuple(r["tags"])) for r in runs} == {
        ("from-env", "named-by-env", ("from-env", "second"))
    }
    assert all(r["stats"] > 0 for r in runs)  # WANDB_X_DISABLE_STATS=false honoured
    assert runs[0]["config"]["model"]["laplacian_heads"] == "learn" and runs[0]["config"]["train"]["max_steps"] == 4
    hist = [h for r in runs for h in r["history"]]
    got = [(h["step"], h["train/loss"]) for h in hist if "train/loss" in h]
    assert got == [(r["step"], r["loss"]) for r in train]
    got_val = [(h["step"], h["val/top1"]) for h in hist if "val/top1" in h]
    assert got_val == [(r["step"], r["top1"]) for r in val]
    tables = [h for h in hist if "val/lap_mix/path" in h]
    assert len(tables) == 3
    table = json.loads((runs[1]["dir"] / "files" / tables[-1]["val/lap_mix/path"]).read_text())
    assert table["columns"] == mix["columns"] and table["data"] == mix["rows"]
    files = runs[1]["dir"] / "files"
    assert (files / "report" / "classify_mixing.png").is_file() and (files / "final" / "metrics.json").is_file()
    assert json.loads((files / "final" / "metrics.json").read_text())["lap_mix"] == last


def test_config_keys_win_over_the_variables_and_the_run_directory_is_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "experiment-from-env")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'elsewhere.db'}")
    out = tmp_path / "run"
    rc = _train(
        out,
        "--set",
        "train.max_steps=2",
        "--set",
        "train.tracker_project=from-config",
        "--set",
        "train.tracker_run_name=named",
        trackers="wandb,mlflow",
    )
    assert rc == 0
    runs = _wandb_run(out)  # no WANDB_DIR: the run directory
    assert len(runs) == 1 and (runs[0]["project"], runs[0]["name"]) == ("from-config", "named")
    assert runs[0]["stats"] == 0  # lapheads' default: no system metrics
    from mlflow.tracking import MlflowClient

    assert not (tmp_path / "mlflow.db").exists()  # MLFLOW_TRACKING_URI honoured
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'elsewhere.db'}")
    run = client.get_run(json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"])
    assert client.get_experiment(run.info.experiment_id).name == "from-config" and run.info.run_name == "named"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == sorted(set(steps))


def test_a_file_store_works_through_mlflows_opt_out_or_is_refused_before_training(tmp_path, monkeypatch, capsys):
    import mlflow.environment_variables as mlflow_env

    mlruns = tmp_path / "mlruns"
    uri = ["--set", f"train.mlflow_tracking_uri={mlruns.as_uri()}", "--set", "train.max_steps=2"]
    if hasattr(mlflow_env, "MLFLOW_ALLOW_FILE_STORE"):  # the releases that refuse a file store
        err = _one_line_refusal(capsys, _train(tmp_path / "refused", *uri, trackers="mlflow"), tmp_path / "refused")
        assert "MLFLOW_ALLOW_FILE_STORE=true" in err and mlruns.as_uri() in err
        assert not mlruns.exists()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    assert _train(out, *uri, trackers="mlflow") == 0
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlruns.as_uri())
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
    losses = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = [(r["step"], r["loss"]) for r in losses if "split" not in r]
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")) == expected


def test_a_database_store_without_sqlalchemy_is_one_line_naming_the_packages(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # importlib.util.find_spec("sqlalchemy") -> None
    out = tmp_path / "run"
    err = _one_line_refusal(capsys, _train(out, trackers="mlflow"), out)
    assert "sqlite:///" in err and "MLflow's default" in err
    assert "pip install sqlalchemy alembic" in err and "lapheads[trackers]" in err


def test_an_unwritable_wandb_dir_is_one_line_and_the_check_leaves_nothing(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("WANDB_DIR", str(blocker / "wandb-home"))
    out = tmp_path / "run"
    err = _one_line_refusal(capsys, _train(out, trackers="wandb"), out)
    assert err.count("WANDB_DIR=") == 1 and "writable directory" in err
    monkeypatch.setenv("WANDB_DIR", "/proc/lapheads-wandb")  # the kernel's: no folder can be made there
    err = _one_line_refusal(capsys, _train(out, trackers="wandb"), out)
    assert "WANDB_DIR=/proc/lapheads-wandb" in err
    bad = tmp_path / "run2"
    err = _one_line_refusal(capsys, _train(bad, "--set", f"train.tracker_dir={blocker}", trackers="wandb"), bad)
    assert f"train.tracker_dir={blocker}" in err
    # a folder that can be made passes, and the check leaves no folder behind (the run makes it)
    check_trackers(["wandb"], tracker_dir=str(tmp_path / "new" / "deeper"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_missing_tracker_package_is_one_line_naming_package_and_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # importlib.util.find_spec("mlflow") -> None
    rc = cli(
        [
            "train",
            "classify",
            "--config",
            DIGITS,
            "--out",
            str(tmp_path / "r"),
            *TINY,
            "--set",
            "train.max_steps=1",
            "--set",
            "train.trackers=[mlflow]",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "'mlflow'" in err and "lapheads[trackers]" in err
    assert not (tmp_path / "r" / "config.yaml").exists()


def test_trackers_config_default_and_duplicates():
    assert TrainConfig().trackers == ["tensorboard"]
    assert TrainConfig(trackers=[]).trackers == []
    with pytest.raises(ConfigError, match="more than once"):
        TrainConfig(trackers=["wandb", "wandb"])
    with pytest.raises(ConfigError, match="trackers"):
        TrainConfig(trackers=["comet"])
