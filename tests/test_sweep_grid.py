"""lapheads sweep --grid / --point: design parsing, run names, resumable grid runs, and the grid report."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lapheads.cli import main as cli
from lapheads.errors import ConfigError
from lapheads.recipes.shipped import CONFIG_DIR
from lapheads.report import curve_series, grid_axes, grid_report, summarise
from lapheads.sweep import axis_names, design_points, parse_grid, parse_point, plan_grid, run_name, split_top

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(CONFIG_DIR / "classify" / "digits.yaml")
TINY = [
    "--set",
    "model.depth=1",
    "--set",
    "model.num_heads=2",
    "--set",
    "train.progress=false",
    "--set",
    "data.batch_size=32",
    "--set",
    "data.max_eval_items=32",
    "--set",
    "train.max_steps=1",
]


def test_design_parsing_and_names():
    assert split_top("1,[0.5, 0.4],'a,b', x") == ["1", "[0.5, 0.4]", "'a,b'", "x"]
    grid = parse_grid(["model.embed_dim=64,128", "data.fraction=0.25,1"])
    assert grid == [("model.embed_dim", ["64", "128"]), ("data.fraction", ["0.25", "1"])]
    uneven = parse_point("model.embed_dim=128,train.max_steps=400")
    design = design_points(grid, [uneven, {"model.embed_dim": "64", "data.fraction": "1"}])
    assert len(design) == 5 and design[-1] == uneven  # 2 x 2 cross product + 1 new point (the other is in it)
    assert design_points(points=[uneven]) == [uneven] and design_points() == [{}]
    short = axis_names(["data.fraction", "model.embed_dim", "train.max_steps"])
    assert (
        run_name("0", 1, {"model.embed_dim": "64", "data.fraction": "0.25"}, short)
        == "fraction=0.25__embed_dim=64__lap0_seed1"
    )  # sorted by key: independent of the order given
    assert run_name("all", 0) == "lapall_seed0"  # no grid: the names sweeps always had
    assert axis_names(["data.batch_size", "train.batch_size"]) == {
        "data.batch_size": "data.batch_size",
        "train.batch_size": "train.batch_size",
    }
    odd = run_name("0", 0, {"data.train": "idx:/data/mnist"}, {"data.train": "train"})
    assert odd.startswith("train=idx-data-mnist-") and "/" not in odd
    assert odd != run_name("0", 0, {"data.train": "idx:/data/mnist2"}, {"data.train": "train"})
    for bad, msg in (
        (["model.laplacian_heads=0,1"], "--laplacian-heads"),
        (["train.seed=1,2"], "--seeds"),
        (["model.embed_dim"], "KEY=V1,V2"),
        (["model.embed_dim=64,"], "empty value"),
        (["a.b=1", "a.b=2"], "given twice"),
    ):
        with pytest.raises(ConfigError, match=msg):
            parse_grid(bad)
    with pytest.raises(ConfigError, match="also set with --set"):
        parse_grid(["train.max_steps=1,2"], overrides=["train.max_steps=5"])
    with pytest.raises(ConfigError, match="must look like KEY=VALUE"):
        parse_point("model.embed_dim=64,128")


def test_bad_grid_point_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match=r"grid point model\.embed_dims=64: unknown config key"):
        plan_grid("classify", DIGITS, ["0"], [0], tmp_path / "s", design=[{"model.embed_dims": "64"}])
    with pytest.raises(ConfigError, match=r"data\.fraction=2"):
        plan_grid("classify", DIGITS, ["0"], [0], tmp_path / "s", design=[{"data.fraction": "2"}])


def test_grid_sweep_trains_skips_and_reports(tmp_path, capsys):
    out = tmp_path / "grid"
    argv = [
        "sweep",
        "--config",
        DIGITS,
        "--laplacian-heads",
        "0,1",
        "--seeds",
        "0",
        "--out",
        str(out),
        "--grid",
        "model.embed_dim=16,32",
        "--point",
        "model.embed_dim=16,data.fraction=0.5",
        *TINY,
    ]
    assert cli(argv) == 0
    names = sorted(p.name for p in out.iterdir() if (p / "config.yaml").is_file())
    assert names == sorted(
        f"{pt}__lap{k}_seed0" for k in (0, 1) for pt in ("embed_dim=16", "embed_dim=32", "fraction=0.5__embed_dim=16")
    )
    cfg = yaml.safe_load((out / "fraction=0.5__embed_dim=16__lap1_seed0" / "config.yaml").read_text())
    assert cfg["model"]["embed_dim"] == 16 and cfg["data"]["fraction"] == 0.5 and cfg["model"]["laplacian_heads"] == 1
    md = (out / "report" / "report.md").read_text()
    assert "| data.fraction | model.embed_dim | Laplacian heads | runs |" in md
    figs = {p.name for p in (out / "report" / "figures").glob("classify_grid_*.png")}
    assert figs == {
        "classify_grid_data.fraction.png",
        "classify_grid_model.embed_dim.png",
        "classify_grid_Laplacian_heads_k.png",
    }
    capsys.readouterr()
    assert cli(argv + ["--no-report"]) == 0  # the same command again: every run is finished
    assert capsys.readouterr().out.count("finished, skipped") == 6


def _fake_run(root: Path, name: str, k: int, seed: int, width: int, top1: float, within: float) -> dict:
    d = root / name
    (d / "final").mkdir(parents=True)
    cfg = {
        "recipe": "classify",
        "model": {"laplacian_heads": k, "embed_dim": width, "num_heads": 4},
        "train": {"seed": seed, "log_every": seed + 1},
    }
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    geo = {
        "layers": {
            "blocks.0": {
                "anova": {"frac_within_sequence": within, "frac_between_class": 0.1},
                "spectra": {"k_mean": 3.0},
                "nc_tokens": {"cdnv": 0.5},
                "cosine": {"cosine_mean": 0.2},
            }
        }
    }
    return {
        "dir": str(d),
        "name": name,
        "recipe": "classify",
        "label": "all" if k == 4 else f"k={k}",
        "seed": seed,
        "final": {"top1": top1},
        "finished": True,
        "train": [],
        "val": [],
        "geometry": geo,
    }


def test_curves_are_drawn_per_grid_point_not_pooled(tmp_path):
    """A sweep over widths: the curve figures draw one line per (k, width), each the mean over its
    seeds, not one line per k pooled over widths whose curves differ by design."""
    runs = [_fake_run(tmp_path, f"w{w}_k{k}_s{s}", k, s, w, 0.5, 0.3) for w in (16, 64) for k in (0, 4) for s in (0, 1)]
    for r in runs:
        width = int(r["name"].split("_")[0][1:])
        r["train"] = [{"step": t, "loss": 10.0 / width + t} for t in (1, 2, 3)]
    groups = summarise(runs)["classify"]
    series = curve_series(groups, lambda run: {x["step"]: x["loss"] for x in run["train"]})
    assert [label for label, _ in series] == [
        "k=0 (embed_dim=16)",
        "k=0 (embed_dim=64)",
        "all (embed_dim=16)",
        "all (embed_dim=64)",
    ]
    for label, curves in series:
        width = int(label.split("embed_dim=")[1].rstrip(")"))
        assert len(curves) == 2 and all(c == {t: 10.0 / width + t for t in (1, 2, 3)} for c in curves)
    one_width = summarise([r for r in runs if r["name"].startswith("w16_")])["classify"]
    assert [label for label, _ in curve_series(one_width, lambda run: {1: 0.0})] == ["k=0", "all"]


def test_grid_report_axes_lines_and_k_ablation(tmp_path):
    runs = [
        _fake_run(tmp_path, f"w{w}_k{k}_s{s}", k, s, w, 0.5 + 0.001 * w + 0.01 * k + 0.01 * s, 0.3 - 0.05 * k)
        for w in (16, 64, 256)
        for k in (0, 2, 4)
        for s in (0, 1)
    ]
    configs = [yaml.safe_load(Path(r["dir"], "config.yaml").read_text()) for r in runs]
    assert grid_axes(configs) == ["model.embed_dim"]  # not k, seed, or the logging cadence
    figs = tmp_path / "figs"
    figs.mkdir()
    tables, made = grid_report(runs, figs)
    ((title, header, rows),) = tables
    assert header[:3] == ["model.embed_dim", "Laplacian heads", "runs"] and "k99" in header
    md = ["| " + " | ".join(r) + " |" for r in rows]
    assert [p.name for p, _ in made] == ["classify_grid_model.embed_dim.png", "classify_grid_Laplacian_heads_k.png"]
    assert all(p.stat().st_size > 1000 for p, _ in made)
    assert "k-ablation" in made[1][1] and "against Laplacian heads k" in made[1][1]
    rows = [line for line in md if line.startswith("| 16 |") or line.startswith("| 256 |")]
    assert len(rows) == 6  # one row per (width, k)
    assert [line.split(" | ")[0] for line in md if line.startswith("| ") and "k=0" in line] == ["| 16", "| 64", "| 256"]
    row = next(line for line in md if line.startswith("| 64 | k=2 |"))
    assert "| 2 | 0.589 ± 0.0071 | 0.2 ± 0 |" in row  # top-1 mean ± std over the two seeds, then within-seq frac
    # runs that differ only in k and seed: no grid table, only the k-ablation figure
    tables2, made2 = grid_report([r for r in runs if "w16_" in r["name"]], figs)
    assert tables2 == [] and [p.name for p, _ in made2] == ["classify_grid_Laplacian_heads_k.png"]


def test_grid_claims_compare_k_within_each_grid_point(tmp_path):
    """Pooled over widths, the spread between grid points hides a clear within-point effect of k."""
    from lapheads.report import claims, grid_claims, summarise
    from lapheads.stats import plateau

    runs = [
        _fake_run(tmp_path, f"w{w}_k{k}_s{s}", k, s, w, 0.5 + 0.001 * w + 0.01 * k + 0.002 * s, 0.3 - 0.05 * k)
        for w in (16, 64, 256)
        for k in (0, 2)
        for s in (0, 1, 2)
    ]
    flags = {r["dir"]: plateau([], []) for r in runs}  # no validation curves: plateau unknown

    def top1(cs: list) -> list:
        return [comp for c in cs if c["key"] == "top1" for comp in c["comparisons"]]

    pooled = top1(claims(summarise(runs), flags))
    assert [c.verdict for c in pooled] == ["not resolved"]  # widths 16..256 move top-1 by 0.24, k by 0.02
    per_point = grid_claims(runs, flags)
    assert [c["point"] for c in per_point if c["key"] == "top1"] == ["embed_dim=16", "embed_dim=64", "embed_dim=256"]
    within = top1(per_point)
    assert [c.verdict for c in within] == ["observed"] * 3 and all(abs(c.diff - 0.02) < 1e-9 for c in within)
    assert grid_claims([r for r in runs if "w16_" in r["name"]], flags) == []  # one point: the pooled verdicts suffice


def _sweep_argv(out: Path, *extra: str) -> list[str]:
    return [
        "sweep",
        "--config",
        DIGITS,
        "--laplacian-heads",
        "0,all",
        "--seeds",
        "0",
        "--out",
        str(out),
        "--no-report",
        *TINY[:-2],
        "--set",
        "train.max_steps=60",
        "--set",
        "train.ckpt_every=5",
        "--set",
        "train.log_every=1",
        "--set",
        "model.embed_dim=32",
        "--set",
        "model.img_size=16",
        "--set",
        "model.patch_size=4",
        *extra,
    ]


@pytest.mark.slow
def test_parallel_sweep_stops_on_sigterm_resumes_and_equals_one_at_a_time(tmp_path, capsys):
    """--jobs 2: two `lapheads train` subprocesses; SIGTERM to the sweep reaches both (each stops at a
    step with a checkpoint); the same command resumes them; the weights equal an in-process sweep's."""
    import signal
    import subprocess
    import sys
    import time

    import torch
    from _reliability_helpers import subprocess_env, train_steps

    from lapheads.engine.checkpoint import load_tensors

    par = tmp_path / "par"
    argv = [sys.executable, "-m", "lapheads.cli", *_sweep_argv(par, "--jobs", "2")]
    p = subprocess.Popen(argv, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        runs = [par / "lap0_seed0", par / "lapall_seed0"]
        while not all((r / "metrics.jsonl").is_file() for r in runs):
            assert p.poll() is None and time.time() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err[-3000:]
    assert "2 runs, 2 at a time (1 thread(s) each)" in out
    for r in runs:
        assert not (r / "final").exists() and (r / "checkpoints" / "latest").is_file()
        assert "interrupted by SIGTERM" in (par / "logs" / f"{r.name}.log").read_text()
    capsys.readouterr()
    assert cli(_sweep_argv(par, "--jobs", "2")) == 0  # the same sweep resumes both (from this process)
    printed = capsys.readouterr().out
    assert printed.count("resuming") == 2 and printed.count("final: top1=") == 2, printed

    one = tmp_path / "one"
    assert cli(_sweep_argv(one)) == 0  # --jobs 1: in this process
    assert not (one / "logs").exists()
    for r in runs:
        assert train_steps(r) == list(range(1, 61))
        a, b = (
            load_tensors(r / "final" / "model.safetensors"),
            load_tensors(one / r.name / "final" / "model.safetensors"),
        )
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5)


def test_parallel_sweep_failure_names_the_run_and_its_log(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LAPHEADS_TEST_NAN_AT_STEP", "2")
    assert cli(_sweep_argv(tmp_path / "s", "--jobs", "2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run lap0_seed0 failed (1 more failed): lapheads train classify: error:" in err[0], err
    assert "non-finite" in err[0].lower() or "nan" in err[0].lower(), err
    assert f"(log: {tmp_path / 's' / 'logs' / 'lap0_seed0.log'})" in err[0]
    monkeypatch.delenv("LAPHEADS_TEST_NAN_AT_STEP")
    with pytest.raises(ConfigError, match="--jobs 0: expected a positive number"):
        from lapheads.sweep import run_grid

        run_grid("classify", DIGITS, ["0"], [0], tmp_path / "z", jobs=0)


def test_two_spellings_of_one_head_setting_are_one_setting():
    # "none", None and 0 Laplacian heads build the same model (here: the same weights and outputs)
    import torch

    from lapheads import timm as lt
    from lapheads.recipes import get_recipe

    same = get_recipe("classify").same_setting
    assert same("model.laplacian_heads", 0, "none") and same("model.laplacian_heads", None, 0)
    assert same("model.laplacian_heads", "01", 1) and same("model.laplacian_heads", "ALL", "all")
    assert not same("model.laplacian_heads", 0, 1) and not same("model.laplacian_heads", "all", "none")
    assert not same("model.embed_dim", 0, None)
    x = torch.randn(2, 3, 32, 32)
    outs = []
    for k in (0, "none"):
        torch.manual_seed(0)
        m = lt.create_model("vit_tiny_patch16_224", laplacian_heads=k, img_size=32, patch_size=8, num_classes=3)
        outs.append(m.eval()(x))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
