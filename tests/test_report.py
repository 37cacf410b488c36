"""Sweep (interrupted and restarted), report files, and the HTML report rendered in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from lapheads.cli import main as cli
from lapheads.recipes.shipped import CONFIG_DIR

# one xdist worker runs this module, so the module-scoped runs are trained once
pytestmark = pytest.mark.xdist_group("report")

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
    "train.progress=false",
    "--set",
    "data.batch_size=32",
    "--set",
    "data.max_eval_items=64",
    "--set",
    "train.ckpt_every=1",
    "--set",
    "train.log_every=1",
    "--set",
    "train.eval_every=1",
]


def _sweep_argv(out: Path, steps: int) -> list[str]:  # (the report's --analyze: tests below)
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
        "--set",
        f"train.max_steps={steps}",
        *TINY,
    ]


def _summary_numbers(path: Path) -> dict:
    s = json.loads(path.read_text())
    return {
        rec: {lb: {k: v for k, v in g.items() if k != "runs"} for lb, g in groups.items()} for rec, groups in s.items()
    }


def _md_tables(md: str) -> list[list[list[str]]]:
    """The Markdown tables of a report: rows of cell texts (header first, the ``|---|`` line dropped),
    split at unescaped ``|`` and unescaped."""
    tables: list[list[list[str]]] = []
    previous = ""
    for line in md.splitlines():
        if line.startswith("|"):
            if not previous.startswith("|"):
                tables.append([])
            if not re.fullmatch(r"\|(---\|)+", line):
                cells = re.split(r"(?<!\\)\|", line.strip()[1:-1])
                tables[-1].append([c.strip().replace("\\|", "|") for c in cells])
        previous = line
    return tables


class _HtmlReport(HTMLParser):
    """The tables (rows of cell texts, header first), images and text of a rendered report.html."""

    def __init__(self, page: str):
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.images: list[dict[str, str]] = []
        self.text: list[str] = []
        self._cell: list[str] | None = None
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            self.images.append(dict(attrs))

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?")


@pytest.mark.slow
def test_interrupted_sweep_skips_finished_runs_and_aggregates_the_same(tmp_path):
    steps = 12
    ref = tmp_path / "ref"
    assert cli(_sweep_argv(ref, steps)) == 0
    ref_summary = _summary_numbers(ref / "report" / "summary.json")

    out = tmp_path / "interrupted"
    import torch

    # the same intra-op thread count as this process: float reductions then match bit for bit
    env = dict(
        os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), LAPHEADS_TEST_THREADS=str(torch.get_num_threads())
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "lapheads.cli", *_sweep_argv(out, steps)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    second = out / "lapall_seed0"
    deadline = time.time() + 300
    # kill once the first run is finished and the second has written a checkpoint but not finished
    while time.time() < deadline:
        if (second / "checkpoints" / "latest").is_file() and not (second / "final").exists():
            break
        assert proc.poll() is None, "the sweep ended before it could be interrupted"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first_final = out / "lap0_seed0" / "final" / "model.safetensors"
    assert first_final.is_file() and not (second / "final" / "model.json").exists()
    mtime = first_final.stat().st_mtime_ns
    assert cli(_sweep_argv(out, steps)) == 0
    assert first_final.stat().st_mtime_ns == mtime, "a finished run was trained again"
    starts = json.loads((second / "meta.json").read_text())["starts"]
    assert [s["resume"] for s in starts] == [False, True]
    assert _summary_numbers(out / "report" / "summary.json") == ref_summary
    md = (out / "report" / "report.md").read_text()
    assert "| k=0 | 1 |" in md and "| all | 1 |" in md


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory) -> list[Path]:
    """Six tiny finished runs (k = 0 / 1 / all x seeds 0, 1), trained once for this module.

    Tests that write into a run (analysis results) work on copies, so every test sees the runs
    exactly as training left them."""
    root = tmp_path_factory.mktemp("tiny_runs")
    dirs = []
    for k in ("0", "1", "all"):
        for seed in (0, 1):
            d = root / f"k{k}_s{seed}"
            assert (
                cli(
                    [
                        "train",
                        "classify",
                        "--config",
                        DIGITS,
                        "--out",
                        str(d),
                        "--set",
                        f"model.laplacian_heads={k}",
                        "--set",
                        f"train.seed={seed}",
                        "--set",
                        "train.max_steps=3",
                        *TINY,
                    ]
                )
                == 0
            )
            dirs.append(d)
    return dirs


def _copies(dirs: list[Path], dest: Path) -> list[Path]:
    out = []
    for d in dirs:
        shutil.copytree(d, dest / d.name)
        out.append(dest / d.name)
    return out


@pytest.fixture(scope="module")
def analyzed_report(tiny_runs, tmp_path_factory) -> tuple[list[Path], Path]:
    """``report --analyze`` over copies of the six runs, made once: the tests below only read it."""
    root = tmp_path_factory.mktemp("analyzed_report")
    dirs = _copies(tiny_runs, root)
    out = root / "rep"
    assert cli(["report", *map(str, dirs), "--out", str(out), "--analyze"]) == 0
    return dirs, out


def test_report_groups_runs_and_references_existing_files(analyzed_report):
    dirs, out = analyzed_report
    md = (out / "report.md").read_text()
    rows = [l for l in md.splitlines() if re.match(r"\| (k=0|k=1|all) \| 2 \|", l)]
    assert len(rows) == 3, md
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for c in cells[2:]:
            assert c != "-" and "nan" not in c.lower(), row
    for ref in re.findall(r"\]\(([^)]+)\)", md):
        assert (out / ref).is_file(), ref
    html = (out / "report.html").read_text()
    assert "src='figures/" not in html and html.count("data:image/png;base64,") >= 4
    summary = json.loads((out / "summary.json").read_text())
    headings = [h for h in md.splitlines() if h.startswith("#")]
    assert [len(h.split(" ", 1)[0]) for h in headings] == [1, 2, 2, 2], md  # title, recipe, claims, runs
    assert headings[1] == "## classify" and headings[3] == "## Runs"
    assert "anova.frac_within_sequence" in summary["classify"]["all"]["comparisons"]
    assert set(summary["classify"]) == {"k=0", "k=1", "all"}
    # validation curves (three eval points per run) and their plateau flags
    assert (out / "figures" / "classify_val_curves.png").is_file()
    runs_table = md[md.index("## Runs") :]
    for d in dirs:
        flag = summary["classify"][{"0": "k=0", "1": "k=1", "all": "all"}[d.name[1:-3]]]["plateau"][d.name]
        assert flag["eval_points"] == 3 and flag["status"] in ("yes", "no")
        assert re.search(rf"\| {d.name} \| classify \| .* \| 3 \| {flag['status']} \(", runs_table), runs_table


def test_report_verdicts_carry_welch_statistics(analyzed_report):
    """Every claim paragraph and summary.json give the difference, its 95% CI, Welch's t and p and
    the seeds; with 2 seeds per setting (or runs at chance) no verdict is given; NC1 is among the claims."""
    from scipy import stats as st

    from lapheads.report import collect_run, run_value
    from lapheads.stats import seeds_needed

    dirs, out = analyzed_report
    md = (out / "report.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    paras = {line.split(".** ", 1)[0][2:]: line for line in md.splitlines() if line.startswith("**classify: ")}
    runs = [collect_run(d) for d in dirs]
    base = [r for r in runs if r["label"] == "k=0"]
    # at chance: top-1 not above 1/10 by a one-sided binomial test over the evaluated images
    chance = {
        r["name"]
        for r in runs
        if st.binomtest(round(r["final"]["top1"] * r["final"]["n"]), r["final"]["n"], 0.1, alternative="greater").pvalue
        >= 0.05
    }
    for label in ("k=1", "all"):
        comps = summary["classify"][label]["comparisons"]
        assert {"top1", "nc_sequence_means.nc1", "classifier_input.nc1", "anova.frac_within_sequence"} <= set(comps)
        other = [r for r in runs if r["label"] == label]
        for key, c in comps.items():
            a = [run_value(r, key) for r in base]
            b = [run_value(r, key) for r in other]
            ref = st.ttest_ind(b, a, equal_var=False)
            assert c["diff"] == pytest.approx(sum(b) / 2 - sum(a) / 2, abs=1e-12)
            assert c["t"] == pytest.approx(ref.statistic) and c["p"] == pytest.approx(ref.pvalue)
            ci = ref.confidence_interval(0.95)
            assert (c["ci_low"], c["ci_high"]) == pytest.approx((ci.low, ci.high))
            assert c["n_baseline"] == c["n_other"] == 2
            # 2 seeds per setting: the statistics, but no verdict; runs at chance say so first
            assert c["verdict"] == ("at chance" if chance & {r["name"] for r in base + other} else "too few seeds")
            if c["p"] >= 0.05:
                assert c["seeds_needed"] == seeds_needed(c["effect_size"])
            # the claim's paragraph carries the same numbers: difference, CI, t, df, p, seeds
            para = paras[c["claim"]]
            for number in (
                f"{c['diff']:+.3g}",
                f"{c['ci_low']:+.3g}",
                f"{c['ci_high']:+.3g}",
                f"{c['t']:.2f}",
                f"{c['df']:.1f}",
                f"{c['p']:.3g}",
            ):
                assert number in para, (number, para)
    assert len(paras) == len(
        {c["claim"] for lb in ("k=1", "all") for c in summary["classify"][lb]["comparisons"].values()}
    )


def test_report_single_seed_is_not_tested_and_integers_print_in_full(tmp_path, tiny_runs):
    dirs = _copies([tiny_runs[0], tiny_runs[4]], tmp_path)  # k=0 and all, one seed each
    m = json.loads((dirs[0] / "final" / "metrics.json").read_text())
    m["n"] = 10000
    (dirs[0] / "final" / "metrics.json").write_text(json.dumps(m))
    # validation curves that rose, then stopped: k0_s0 flat over the window, kall_s0 stopped by
    # train.until_plateau at step 3 (a little below its best, which still counts as a plateau)
    for d, curve in ((dirs[0], [0.2, 0.5, 0.5]), (dirs[1], [0.3, 0.5, 0.49])):
        records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        vals = iter(curve)
        records = [{**r, "top1": next(vals)} if r.get("split") == "val" else r for r in records]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with open(dirs[1] / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "event": "until_plateau_stop", "metric": "top1"}) + "\n")
    out = tmp_path / "rep"
    assert cli(["report", *map(str, dirs), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "n=10000" in md and "e+04" not in md
    comps = json.loads((out / "summary.json").read_text())["classify"]["all"]["comparisons"]
    assert comps and all(c["verdict"] == "single run" and c["p"] is None and c["t"] is None for c in comps.values())
    assert all(c["convergence"] == "" for c in comps.values())  # every compared run plateaued
    rows = {r[0]: r for r in _md_tables(md)[-1][1:]}  # the runs table, by run name
    assert rows["k0_s0"][:6] == ["k0_s0", "classify", "k=0", "0", "3", rows["k0_s0"][5]]
    assert rows["k0_s0"][5] == "yes (0% change since step 2)"
    assert rows["kall_s0"][5].startswith("yes") and re.findall(r"\d+", rows["kall_s0"][5]) == ["3"]  # stopped at 3
    assert cli(["report", *map(str, dirs), "--out", str(tmp_path / "bad"), "--plateau-window", "0"]) == 2


def test_number_formatting():
    from lapheads.report import fmt, num

    assert num(10000) == "10000" and num(10000.0) == "10000" and num(123456.7) == "123457"
    assert num(0.123456) == "0.1235" and num(True) == "True"
    assert fmt(12000.0, 1500.0, 3) == "12000 ± 1500"


def test_pca_images_come_from_several_classes_and_in_colour(tmp_path):
    from PIL import Image

    from lapheads.data.images import load_images, spread_over_classes

    assert spread_over_classes([0, 0, 0, 1, 1, 2], 4) == [0, 3, 5, 1]
    assert spread_over_classes(["b", "a", "b"], 5) == [1, 0, 2]
    colours = {"cat": (255, 0, 0), "dog": (0, 255, 0), "eel": (0, 0, 255)}
    for name, rgb in colours.items():  # a class-sorted folder: the first 3 files are all "cat"
        (tmp_path / name).mkdir()
        for i in range(4):
            Image.new("RGB", (8, 8), rgb).save(tmp_path / name / f"{i}.png")
    imgs = load_images(str(tmp_path), max_images=3)
    assert sorted(im.getpixel((0, 0)) for im in imgs) == sorted(colours.values())
    digits = load_images("digits", max_images=10)  # a data spec: one image of each of the 10 digits
    from lapheads.data.images import build_image_dataset

    ds = build_image_dataset("digits", "val")
    idx = spread_over_classes(list(ds.targets), 10)
    assert sorted(int(ds.targets[i]) for i in idx) == list(range(10)) and len(digits) == 10


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium not installed (make test installs it)")
def test_html_report_renders_with_every_image_loaded(tmp_path, analyzed_report):
    out = analyzed_report[1]
    r = subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'chrome'}",
            "--virtual-time-budget=10000",
            "--dump-dom",
            (out / "report.html").resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    m = re.search(r'data-images-total="(\d+)" data-images-loaded="(\d+)"', r.stdout)
    assert m, r.stdout[:500] + r.stderr[-500:]
    total, loaded = int(m.group(1)), int(m.group(2))
    assert total >= 4 and loaded == total


def test_analyze_cli_on_runs_of_this_project(tmp_path, tiny_runs):
    dirs = _copies([tiny_runs[0], tiny_runs[4]], tmp_path)  # k=0 and k=all, seed 0
    assert not any((d / "geometry").exists() for d in dirs)
    out = tmp_path / "geo"
    assert cli(["analyze", "--run", str(dirs[0]), "--run", str(dirs[1]), "--max-items", "64", "--out", str(out)]) == 0
    res = json.loads((out / "geometry.json").read_text())
    assert set(res["runs"]) == {"k0_s0", "kall_s0"}
    for r in res["runs"].values():
        a = r["layers"]["blocks.1"]["anova"]
        parts = a["within_sequence"] + a["between_sequence_within_class"] + a["between_class"]
        assert abs(parts - a["total"]) <= 1e-9 * a["total"]
    assert len(list(out.glob("*.png"))) >= 4
    for d in dirs:  # each run also keeps its own geometry.json for the report
        assert (d / "geometry" / "geometry.json").is_file()
    assert cli(["analyze", "--run", str(tmp_path / "missing"), "--out", str(out)]) == 2


def test_report_reads_the_metric_keys_each_recipe_logs():
    """The report's dino metrics are the keys DINO's evaluation writes (knn_k{k}_top1)."""
    import torch

    from lapheads.recipes import get_recipe
    from lapheads.recipes.dino import KnnConfig
    from lapheads.vision.probes import knn_classify

    f = torch.randn(30, 4)
    y = torch.arange(30) % 3
    logged = knn_classify(f, y, f[:6], y[:6], ks=KnnConfig().ks)
    assert {m.key for m in get_recipe("dino").metrics} <= set(logged)


def test_markdown_and_html_show_the_same_model(analyzed_report, tmp_path):
    """One model, two renderings: the same figures (files on disk, embedded byte for byte in the
    HTML) and the same tables, so every number of the model's tables is in both outputs."""
    import base64

    from lapheads.report import fmt, make_report, render_html, render_markdown

    dirs, _ = analyzed_report
    out = tmp_path / "rep"
    report = make_report(dirs, out)
    md, page = render_markdown(report), render_html(report, out)
    parsed = _HtmlReport(page)

    figures = {f.path for f in report.figures()}
    assert len(figures) >= 4 and all((out / f).is_file() for f in figures)
    assert {m.group(1) for m in re.finditer(r"!\[(?:[^\]\\]|\\.)*\]\(([^)]+)\)", md)} == figures
    assert len(parsed.images) == len(report.figures())
    assert {im["data-file"] for im in parsed.images} == figures
    for im in parsed.images:  # self-contained: each figure's own bytes, not a link
        head, data = im["src"].split(",", 1)
        assert head == "data:image/png;base64" and base64.b64decode(data) == (out / im["data-file"]).read_bytes()

    model = [[t.header] + [[c.text for c in row] for row in t.rows] for t in report.tables()]
    assert len(model) == 2 and all(len(t) > 1 for t in model)  # the settings table and the runs table
    assert _md_tables(md) == model and parsed.tables == model
    numbers = [n for t in model for row in t for c in row for n in _NUMBER.findall(c)]
    assert len(numbers) > 50
    md_text, html_text = md, "".join(parsed.text)
    for n in numbers:
        assert n in md_text and n in html_text, n
    settings = report.tables()[0]
    for row in settings.rows:  # the cells keep the numbers they show
        assert row[1].raw == 2 and row[2].raw[1] == 2
        for c in row[3:]:
            assert c.raw[2] == 2 and c.text == fmt(*c.raw)
    for v in (v for s in report.sections for v in s.verdicts):  # every claim with its statistics, in both
        assert f"**{v.claim}.** {v.text}" in md and v.text in html_text
        for c in v.comparisons:
            assert f"{c.p:.3g}" in v.text and f"{c.diff:+.3g}" in v.text


def test_templates_escape_what_would_break_each_format(tmp_path):
    from lapheads.report import Cell, Figure, Report, Section, Table, render_html, render_markdown

    hostile = "<script>x</script> a|b & 'c'"
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "f.png").write_bytes(b"\x89PNG")
    report = Report(
        hostile,
        [hostile],
        [
            Section(
                hostile,
                tables=[Table(["h|1", "h2"], [[Cell(hostile), Cell("1")]])],
                figures=[Figure("figures/f.png", hostile, "alt [x]")],
            )
        ],
        {},
    )
    md = render_markdown(report)
    assert _md_tables(md) == [[["h|1", "h2"], [hostile, "1"]]]
    assert "![alt \\[x\\]](figures/f.png)" in md
    page = render_html(report, tmp_path)
    assert "<script>x" not in page and page.count("&lt;script&gt;x&lt;/script&gt;") == 6  # title x2, p, h2, td, caption
    parsed = _HtmlReport(page)
    assert parsed.tables == [[["h|1", "h2"], [hostile, "1"]]] and parsed.images[0]["alt"] == "alt [x]"


def test_the_report_states_what_was_run_from_the_runs(analyzed_report):
    """Seeds, steps, eval points, plateau and chance counts are read from the runs (not a template),
    and with 2 seeds per setting no comparison gives an observed / opposite verdict."""
    dirs, out = analyzed_report
    md = (out / "report.md").read_text()
    para = next(line for line in md.split("## classify", 1)[1].splitlines() if line.startswith("What was run:"))
    seeds: dict[str, list[int]] = {}
    steps, evals = set(), set()
    for d in dirs:
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        k = {0: "k=0", 1: "k=1"}.get(cfg["model"]["laplacian_heads"], "all")
        seeds.setdefault(k, []).append(cfg["train"]["seed"])
        records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        steps.add(max(r["step"] for r in records if "step" in r))
        evals.add(sum(r.get("split") == "val" for r in records))
    for k in ("k=0", "k=1", "all"):
        assert f"{k}: 2 run(s), seed(s) {', '.join(map(str, seeds[k]))}" in para, para
    assert f"Optimizer steps per run: {steps.pop()}." in para and f"Validation points per run: {evals.pop()}." in para
    summary = json.loads((out / "summary.json").read_text())
    flags = [f for g in summary["classify"].values() for f in g["plateau"].values()]
    assert f"Plateaued: {sum(f['status'] == 'yes' for f in flags)} of 6 runs" in para
    assert "at least 3 are needed" in para and "3 seeds each" not in md and "trustworthy" not in md
    verdicts = [c["verdict"] for g in summary["classify"].values() for c in g["comparisons"].values()]
    assert verdicts and set(verdicts) <= {"too few seeds", "at chance"}
    assert ": observed" not in md and ": opposite" not in md


def test_html_is_the_markdown_converted(analyzed_report, tmp_path):
    """One Markdown-to-HTML path: Markdown in the intro is formatted in the page, never shown raw."""
    from lapheads.report import make_report, render_html

    dirs, _ = analyzed_report
    out = tmp_path / "rep"
    report = make_report(dirs[:2], out, intro="**Bold claim.** See `lapheads report` and the *runs*.")
    page = render_html(report, out)
    assert "<strong>Bold claim.</strong>" in page and "<code>lapheads report</code>" in page
    assert "<em>runs</em>" in page
    text = "".join(_HtmlReport(page).text)
    assert "**" not in text and "`" not in text


def _fake_groups(tmp_path: Path, points: dict[str, int], top1: dict[str, list[float]]) -> dict:
    """Settings -> {"runs": [...]} of classify runs made up here: ``points[label]`` training-loss
    points per run and ``top1[label]`` the final top-1 of each seed."""
    from lapheads.report import summarise

    runs = []
    for label, values in top1.items():
        for seed, v in enumerate(values):
            d = tmp_path / f"{label}_{seed}"
            d.mkdir(parents=True)
            k = 0 if label == "k=0" else 4
            cfg = {"recipe": "classify", "model": {"laplacian_heads": k}, "train": {"seed": seed}}
            (d / "config.yaml").write_text(yaml.safe_dump(cfg))
            runs.append(
                {
                    "dir": str(d),
                    "name": d.name,
                    "recipe": "classify",
                    "label": label,
                    "seed": seed,
                    "final": {"top1": v},
                    "finished": True,
                    "train": [
                        {"step": 10 * (i + 1), "loss": 2.0 - 0.1 * i - 0.01 * seed} for i in range(points[label])
                    ],
                    "val": [],
                    "geometry": None,
                    "chance": {"top1": 0.1},
                    "at_chance": "top-1 acc at chance" if v <= 0.1 else None,
                }
            )
    return summarise(runs)["classify"]


def test_curves_of_fewer_than_3_points_are_left_out_with_a_sentence(tmp_path):
    from PIL import Image

    from lapheads.report.figures import curve_note, fig_curves

    groups = _fake_groups(tmp_path, {"k=0": 1, "all": 2}, {"k=0": [0.5, 0.6], "all": [0.5, 0.6]})
    assert fig_curves(groups, tmp_path / "short.png", "classify") is None and not (tmp_path / "short.png").exists()
    note = curve_note(groups, "classify", "loss")
    assert note.startswith("Training loss: logged at 1 to 2 step(s) per run, fewer than 3, so no curve is drawn")
    # one setting long enough: drawn, the short one as markers beside it
    groups = _fake_groups(tmp_path / "b", {"k=0": 3, "all": 1}, {"k=0": [0.5, 0.6], "all": [0.5, 0.6]})
    path = fig_curves(groups, tmp_path / "long.png", "classify")
    assert path is not None and Image.open(path).size[0] > 100


def test_layer_axes_are_whole_numbers_named_by_layer():
    from lapheads.report.figures import layer_axis, pyplot

    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot(range(3), [1.0, 2.0, 3.0])
    layer_axis(ax, ["hidden.0", "hidden.1", "hidden.2"])
    assert list(ax.get_xticks()) == [0, 1, 2]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["hidden.0", "hidden.1", "hidden.2"]
    plt.close(fig)


def test_runs_at_chance_get_no_verdict_even_with_enough_seeds(tmp_path):
    """Three seeds per setting and p < 0.05, but the Laplacian runs are at chance: no verdict."""
    from lapheads.report import claims

    points = {"k=0": 3, "all": 3}
    clear = _fake_groups(tmp_path / "a", points, {"k=0": [0.50, 0.51, 0.52], "all": [0.60, 0.61, 0.62]})
    stuck = _fake_groups(tmp_path / "b", points, {"k=0": [0.50, 0.51, 0.52], "all": [0.08, 0.09, 0.10]})
    for groups, verdict in ((clear, "observed"), (stuck, "at chance")):
        (top1,) = [c for c in claims({"classify": groups}) if c["key"] == "top1"]
        (comp,) = top1["comparisons"]
        assert comp.p < 0.05 and comp.verdict == verdict
    assert "no verdict, 3 of 6 runs compared are at chance (all_0, all_1, all_2)" in top1["text"]
