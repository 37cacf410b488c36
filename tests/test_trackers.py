"""``train.trackers``: W&B (offline) and MLflow (local file store) on a tiny classify run, and its resume.

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


def _wandb_run(run_dir: Path):
    """(run id, config keys, history rows) of each offline W&B run under ``run_dir/wandb``, in order."""
    out = []
    for d in sorted((run_dir / "wandb").glob("offline-run-*")):
        run_id, config, history = None, {}, []
        for rec in _wandb_records(next(d.glob("run-*.wandb"))):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run_id = rec.run.run_id
                config = {i.key: json.loads(i.value_json) for i in rec.run.config.update}
            elif kind == "history":
                history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
        out.append((d, run_id, config, history))
    return out


def _train(out: Path, mlruns: Path, *extra: str) -> int:
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
            "train.trackers=[tensorboard,wandb,mlflow]",
            "--set",
            f"train.mlflow_tracking_uri={mlruns.as_uri()}",
            *extra,
        ]
    )


def test_wandb_offline_and_mlflow_receive_config_metrics_mixing_and_figures_and_resume_continues(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for this opt-in to a file store
    out, mlruns = tmp_path / "run", tmp_path / "mlruns"
    assert _train(out, mlruns, "--set", "train.max_steps=4") == 0
    ids = json.loads((out / "trackers.json").read_text())
    assert _train(out, mlruns, "--set", "train.max_steps=6", "--resume") == 0
    assert json.loads((out / "trackers.json").read_text()) == ids  # the same tracker runs continued
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "split" not in r]
    val = [r for r in records if r.get("split") == "val"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6] and [r["step"] for r in val] == [2, 4, 6]
    assert (out / "tb").is_dir()  # tensorboard as before

    # MLflow: one run, metrics read back through the client equal metrics.jsonl
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlruns.as_uri())
    run_id = ids["mlflow"]["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["model.laplacian_heads"] == "learn"
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
    assert mix["columns"][:4] == ["layer", "head", "a", "b"]
    assert [r[:4] for r in mix["rows"]] == [
        [row["layer"], h, a, b] for row in last for h, (a, b) in enumerate(zip(row["a"], row["b"]))
    ]

    # W&B: two offline attempts of one run id; their history together equals metrics.jsonl
    runs = _wandb_run(out)
    assert len(runs) == 2 and {r[1] for r in runs} == {ids["wandb"]["run_id"]}
    assert runs[0][2]["model"]["laplacian_heads"] == "learn" and runs[0][2]["train"]["max_steps"] == 4
    hist = [h for r in runs for h in r[3]]
    got = [(h["step"], h["train/loss"]) for h in hist if "train/loss" in h]
    assert got == [(r["step"], r["loss"]) for r in train]
    got_val = [(h["step"], h["val/top1"]) for h in hist if "val/top1" in h]
    assert got_val == [(r["step"], r["top1"]) for r in val]
    tables = [h for h in hist if "val/lap_mix/path" in h]
    assert len(tables) == 3
    table = json.loads((runs[1][0] / "files" / tables[-1]["val/lap_mix/path"]).read_text())
    assert table["columns"] == ["layer", "head", "a", "b", "laplacianness"]
    assert [r[:4] for r in table["data"]] == [r[:4] for r in mix["rows"]]
    files = runs[1][0] / "files"
    assert (files / "report" / "classify_mixing.png").is_file() and (files / "final" / "metrics.json").is_file()
    assert json.loads((files / "final" / "metrics.json").read_text())["lap_mix"] == last


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
