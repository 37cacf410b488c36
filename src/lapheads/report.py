"""``lapheads report RUN_DIR [RUN_DIR ...]``: compare runs, grouped by their Laplacian heads.

Writes ``report.md`` (figures beside it in ``figures/``) and a self-contained ``report.html``
(the same figures embedded as data URIs). For every recipe present:

* a table with one row per Laplacian-head setting: runs, the recipe's metrics and the geometry
  of the last block as mean +- std over seeds;
* figures: training curves, the main metric per setting, ANOVA fractions / k99 / cosine per layer,
  singular-value spectra, and (vision) PCA maps of a few images' patch tokens;
* one paragraph per claim of the paper, saying from these numbers whether this run observed it.
  A difference smaller than the spread over seeds is reported as such, not as an effect.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from .errors import ConfigError
from .heads import LaplacianHeads

# recipe -> [(metric key in final/metrics.json, label, higher is better)]
METRICS = {
    "classify": [("top1", "top-1 acc", True), ("top5", "top-5 acc", True),
                 ("mean_class_acc", "mean class acc", True), ("loss", "val loss", False)],
    "lm": [("val_bpb", "val bits/byte", False), ("val_loss", "val loss", False)],
    "sft": [("val_loss", "val loss (assistant tokens)", False)],
    "dino": [("knn_top1", "k-NN top-1", True), ("knn20_top1", "20-NN top-1", True),
             ("linear_top1", "linear top-1", True)],
}
# geometry numbers summarised in the table: (section, key, label)
GEOMETRY = [("anova", "frac_within_sequence", "within-seq frac"),
            ("anova", "frac_between_class", "between-class frac"),
            ("spectra", "k_mean", "k99"),
            ("cosine", "cosine_mean", "cosine"),
            ("nc_sequence_means", "nc1", "NC1 (seq means)"),
            ("nc_tokens", "cdnv", "CDNV (tokens)")]


# ----------------------------------------------------------------------------------- collection
def _k_sort_key(label: str) -> tuple:
    if label == "none" or label == "k=0":
        return (0, 0)
    if label.startswith("k="):
        return (1, int(label[2:]))
    if label == "all":
        return (2, 0)
    return (3, label)


def collect_run(run_dir: Path) -> dict[str, Any]:
    from .engine.run import RunDir
    from .geometry.runs import load_geometry
    from .outputs import read_json
    run = RunDir(run_dir)
    cfg = run.read_config()
    spec = (cfg.get("model") or {}).get("laplacian_heads", 0)
    if cfg["recipe"] == "sft" and cfg.get("init_from"):  # SFT keeps the heads of the run it started from
        base = Path(cfg["init_from"])
        if (base / "config.yaml").is_file():
            spec = (RunDir(base).read_config().get("model") or {}).get("laplacian_heads", 0)
    label = LaplacianHeads(spec).label()
    if label == "none":
        label = "k=0"
    final = run.final_dir / "metrics.json"
    records = run.metrics()
    return {
        "dir": str(run.path), "name": run.path.name, "recipe": cfg["recipe"], "label": label,
        "seed": (cfg.get("train") or {}).get("seed", 0),
        "final": read_json(final, "the final metrics of a run") if final.is_file() else {},
        "finished": (run.final_dir / "model.json").is_file(),
        "train": [r for r in records if "loss" in r and r.get("split") is None],
        "val": [r for r in records if r.get("split") == "val"],
        "geometry": load_geometry(run.path),
    }


def _last_block(geo: dict) -> Optional[str]:
    names = [n for n in geo.get("layers", {}) if n != "pre_logits"]
    return names[-1] if names else None


def _geo_value(geo: Optional[dict], layer: Optional[str], section: str, key: str) -> Optional[float]:
    if not geo or layer is None:
        return None
    v = geo["layers"].get(layer, {}).get(section, {}).get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _mean_std(xs: list[float]) -> tuple[float, float, int]:
    a = np.asarray([x for x in xs if x is not None and math.isfinite(x)], dtype=float)
    if a.size == 0:
        return float("nan"), float("nan"), 0
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0, int(a.size)


def _fmt(m: float, s: float, n: int, digits: int = 4) -> str:
    if n == 0 or not math.isfinite(m):
        return "-"
    return f"{m:.{digits}g} ± {s:.2g}" if n > 1 else f"{m:.{digits}g}"


def summarise(runs: list[dict]) -> dict[str, dict[str, dict[str, Any]]]:
    """recipe -> label -> {"runs": [...], metric/geometry key -> (mean, std, n)}."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(r["recipe"], {}).setdefault(r["label"], {"runs": []})["runs"].append(r)
    for recipe, groups in out.items():
        for label, g in groups.items():
            for key, _, _ in METRICS.get(recipe, []):
                g[key] = _mean_std([r["final"].get(key) for r in g["runs"]])
            for section, key, _ in GEOMETRY:
                g[f"{section}.{key}"] = _mean_std([
                    _geo_value(r["geometry"], _last_block(r["geometry"]) if r["geometry"] else None, section, key)
                    for r in g["runs"]])
        out[recipe] = dict(sorted(groups.items(), key=lambda kv: _k_sort_key(kv[0])))
    return out


# ----------------------------------------------------------------------------------- figures
def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _finish_lines(plt, fig, ax, drawn: bool, path: Path, xlabel: str, ylabel: str, title: str) -> Optional[Path]:
    """Label, save and close a line figure; None (nothing written) when no line was drawn."""
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fig_curves(groups: dict, path: Path, recipe: str) -> Optional[Path]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    drawn = False
    for label, g in groups.items():
        curves = [r["train"] for r in g["runs"] if r["train"]]
        if not curves:
            continue
        steps = sorted(set.intersection(*[set(x["step"] for x in c) for c in curves]))
        if not steps:
            continue
        vals = np.array([[{x["step"]: x["loss"] for x in c}[s] for s in steps] for c in curves])
        m = vals.mean(0)
        ax.plot(steps, m, label=f"{label} (n={len(curves)})")
        if len(curves) > 1:
            sd = vals.std(0, ddof=1)
            ax.fill_between(steps, m - sd, m + sd, alpha=0.2)
        drawn = True
    return _finish_lines(plt, fig, ax, drawn, path, "optimizer step", "training loss",
                         f"{recipe}: training loss (mean ± std over seeds)")


def _fig_metric(groups: dict, path: Path, recipe: str) -> Optional[Path]:
    metrics = METRICS.get(recipe, [])
    if not metrics:
        return None
    key, name, _ = metrics[0]
    labels = [lb for lb, g in groups.items() if g[key][2] > 0]
    if not labels:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    means = [groups[lb][key][0] for lb in labels]
    stds = [groups[lb][key][1] for lb in labels]
    ax.bar(labels, means, yerr=stds, capsize=4, color="#4c72b0")
    for lb in labels:  # the individual seeds
        xs = [r["final"].get(key) for r in groups[lb]["runs"] if r["final"].get(key) is not None]
        ax.scatter([lb] * len(xs), xs, color="k", s=10, zorder=3)
    lo, hi = min(means) - 3 * max(max(stds), 1e-3), max(means) + 3 * max(max(stds), 1e-3)
    ax.set_ylim(lo, hi)
    ax.set_ylabel(name)
    ax.set_title(f"{recipe}: {name} per Laplacian-head setting")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fig_layers(groups: dict, path: Path, recipe: str) -> Optional[Path]:
    panels = [("anova", "frac_within_sequence", "within-sequence fraction"),
              ("anova", "frac_between_class", "between-class fraction"),
              ("spectra", "k_mean", "k99 (per sequence)"),
              ("cosine", "cosine_mean", "mean within-sequence cosine")]
    any_geo = any(r["geometry"] for g in groups.values() for r in g["runs"])
    if not any_geo:
        return None
    panels = [p for p in panels if any(
        _geo_value(r["geometry"], _last_block(r["geometry"]), p[0], p[1]) is not None
        for g in groups.values() for r in g["runs"] if r["geometry"])]
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.2), squeeze=False)
    for ax, (section, key, title) in zip(axes[0], panels):
        for label, g in groups.items():
            geos = [r["geometry"] for r in g["runs"] if r["geometry"]]
            if not geos:
                continue
            layers = [n for n in geos[0]["layers"] if n != "pre_logits"]
            vals = np.array([[_geo_value(gg, n, section, key) or np.nan for n in layers] for gg in geos])
            m = np.nanmean(vals, 0)
            ax.plot(range(len(layers)), m, "-o", ms=3, label=label)
            if len(geos) > 1:
                sd = np.nanstd(vals, 0, ddof=1)
                ax.fill_between(range(len(layers)), m - sd, m + sd, alpha=0.2)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{recipe}: token geometry per layer (mean ± std over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fig_spectra(groups: dict, path: Path, recipe: str) -> Optional[Path]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    drawn = False
    for label, g in groups.items():
        curves = []
        for r in g["runs"]:
            geo = r["geometry"]
            layer = _last_block(geo) if geo else None
            c = geo["layers"][layer].get("spectra", {}).get("sequence_curve") if layer else None
            if c:
                curves.append(np.asarray(c, dtype=float))
        if not curves:
            continue
        n = min(len(c) for c in curves)
        m = np.mean([c[:n] for c in curves], 0)
        n = max(1, int((m > 1e-9).sum()))  # beyond the rank (tokens per sequence) only round-off is left
        ax.semilogy(np.arange(1, n + 1), m[:n], "-o", ms=2, label=label)
        drawn = True
    return _finish_lines(plt, fig, ax, drawn, path, "principal component", "fraction of variance",
                         f"{recipe}: per-sequence spectrum, last block")


def _fig_pca(groups: dict, path: Path, recipe: str = "classify") -> Optional[Path]:
    """PCA maps (top 3 components of patch tokens as RGB) of a few validation images per setting.

    ``classify``: the classifier's ViT with the run's evaluation transform; ``dino``: the teacher
    backbone with the probes' transform (``lapheads pca-maps``), on ``data.val_split``.
    """
    import torch
    from .data.images import build_image_dataset
    from .data.transforms import build_transforms
    from .engine.config import from_dict
    from .geometry import pca_rgb
    from .recipes.classify import ClassifyConfig, load_model
    reps = [(lb, g["runs"][0]) for lb, g in groups.items() if g["runs"] and g["runs"][0]["finished"]]
    if not reps:
        return None
    from .engine.run import RunDir
    raw = json.loads(json.dumps(RunDir(reps[0][1]["dir"]).read_config()))
    raw.pop("recipe")
    if recipe == "dino":
        from .recipes.dino import DinoConfig, EvalTransform
        from .recipes.probes import load_backbone
        dcfg = from_dict(DinoConfig, raw)
        ds = build_image_dataset(dcfg.data.val or dcfg.data.train, split=dcfg.data.val_split)
        meta = load_backbone(run=reps[0][1]["dir"])[1]
        tf = EvalTransform(meta["img_size"], meta["mean"], meta["std"])
        loader = lambda d: load_backbone(run=d)[0]  # noqa: E731
    else:
        cfg = from_dict(ClassifyConfig, raw)
        ds = build_image_dataset(cfg.data.val or cfg.data.train, split="val")
        tf = build_transforms(cfg.model.img_size, train=False, mean=cfg.data.mean, std=cfg.data.std)
        loader = lambda d: load_model(Path(d))  # noqa: E731
    idx = list(range(min(6, len(ds))))
    imgs = torch.stack([tf(ds[i][0]) for i in idx])
    plt = _plt()
    fig, axes = plt.subplots(len(reps) + 1, len(idx), figsize=(1.3 * len(idx), 1.35 * (len(reps) + 1)),
                             squeeze=False)
    for j, i in enumerate(idx):
        axes[0][j].imshow(np.asarray(ds[i][0].convert("L")), cmap="gray")
        axes[0][j].set_axis_off()
    axes[0][0].set_title("input", fontsize=7, loc="left")
    for row, (label, r) in enumerate(reps, start=1):
        model = loader(r["dir"])
        with torch.no_grad():
            toks = model.forward_intermediates(imgs, indices=[len(model.blocks) - 1], intermediates_only=True,
                                               output_fmt="NLC")[-1]
        patches = toks  # forward_intermediates drops the CLS/register tokens by default
        side = int(round(math.sqrt(patches.shape[1])))
        rgb = pca_rgb(patches, (side, side))
        for j in range(len(idx)):
            axes[row][j].imshow(rgb[j], interpolation="nearest")
            axes[row][j].set_axis_off()
        axes[row][0].set_title(label, fontsize=7, loc="left")
    fig.suptitle("PCA maps of last-block patch tokens (one seed per setting)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------- claims
def _compare(groups: dict, key: str) -> Optional[tuple[str, tuple, str, tuple]]:
    """(baseline label, stats, most-Laplacian label, stats) when both exist with data."""
    labels = [lb for lb in groups if groups[lb][key][2] > 0]
    if "k=0" not in labels or len(labels) < 2:
        return None
    other = [lb for lb in labels if lb != "k=0"][-1]
    return "k=0", groups["k=0"][key], other, groups[other][key]


def _verdict(base: tuple, lap: tuple, want_lower: bool) -> str:
    (m0, s0, n0), (m1, s1, n1) = base, lap
    diff = m1 - m0
    good = diff < 0 if want_lower else diff > 0
    spread = max(s0, s1)
    if n0 > 1 and n1 > 1 and abs(diff) <= spread:
        return "not resolved (the difference is within the spread over seeds)"
    verdict = "observed" if good else "not observed (the opposite direction)"
    if n0 < 2 or n1 < 2:
        verdict += " in a single run per setting, with no estimate of the spread over seeds"
    return verdict


def claims(summary: dict) -> list[tuple[str, str]]:
    out = []
    spec = [
        ("anova.frac_within_sequence", True, "Laplacian heads shrink the within-sequence variance",
         "within-sequence fraction of the token variance, last block"),
        ("anova.frac_between_class", False, "Laplacian heads grow the between-class variance",
         "between-class fraction of the token variance, last block"),
        ("spectra.k_mean", True, "Laplacian heads make spectra decay faster (lower k99)",
         "components for 99% of a sequence's variance, last block"),
        ("nc_tokens.cdnv", True, "Laplacian heads make classes more separable (lower CDNV)",
         "CDNV of tokens by class (next token for a language model), last block"),
    ]
    for recipe, groups in summary.items():
        metrics = METRICS.get(recipe, [])
        for key, lower, what, _how in spec:
            c = _compare(groups, key)
            if c is None:
                continue
            b, sb, l, sl = c
            out.append((f"{recipe}: {what}",
                        f"{_verdict(sb, sl, lower).capitalize()}. {how_measured(key, spec)}: "
                        f"{b} {_fmt(*sb)} vs {l} {_fmt(*sl)} (mean ± std over {sb[2]} and {sl[2]} runs)."))
        if metrics:
            key, name, higher = metrics[0]
            c = _compare(groups, key)
            if c is not None:
                b, sb, l, sl = c
                claim = "raise the accuracy" if higher else f"lower the {name}"
                out.append((f"{recipe}: Laplacian heads {claim}",
                            f"{_verdict(sb, sl, not higher).capitalize()}. {name}: {b} {_fmt(*sb)} vs "
                            f"{l} {_fmt(*sl)} (mean ± std over {sb[2]} and {sl[2]} runs)."))
    return out


def how_measured(key: str, spec: list) -> str:
    for k, _, _, how in spec:
        if k == key:
            return how[0].upper() + how[1:]
    return key


# ----------------------------------------------------------------------------------- rendering
def _table_rows(recipe: str, groups: dict) -> tuple[list[str], list[list[str]]]:
    metrics = [(k, n) for k, n, _ in METRICS.get(recipe, []) if any(g[k][2] for g in groups.values())]
    geo = [(f"{s}.{k}", n) for s, k, n in GEOMETRY if any(g[f"{s}.{k}"][2] for g in groups.values())]
    header = ["Laplacian heads", "runs"] + [n for _, n in metrics] + [n for _, n in geo]
    rows = []
    for label, g in groups.items():
        rows.append([label, str(len(g["runs"]))] + [_fmt(*g[k]) for k, _ in metrics] + [_fmt(*g[k]) for k, _ in geo])
    return header, rows


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in header)
    b = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{b}</tbody></table>"


_CSS = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0;font-size:14px}td,th{border:1px solid #ccc;padding:4px 8px}"
        "th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee;margin:.5em 0}"
        ".claim{margin:.6em 0}.claim b{display:block}")
# Lets a headless browser (and the test suite) check that every figure decoded.
_IMG_CHECK = ("<script>window.addEventListener('load',function(){var im=document.images,ok=0;"
              "for(var i=0;i<im.length;i++){if(im[i].complete&&im[i].naturalWidth>0)ok++;}"
              "document.body.setAttribute('data-images-total',im.length);"
              "document.body.setAttribute('data-images-loaded',ok);});</script>")


def build_report(run_dirs: Sequence[str | Path], out_dir: str | Path, title: str = "lapheads report",
                 intro: str = "") -> dict[str, Path]:
    """Write ``report.md``, ``report.html`` and ``figures/`` comparing ``run_dirs``."""
    if not run_dirs:
        raise ConfigError("no run directories given to the report")
    runs = [collect_run(Path(d)) for d in run_dirs]
    out = Path(out_dir)
    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    summary = summarise(runs)
    md: list[str] = [f"# {title}", "", f"Generated {time.strftime('%Y-%m-%d %H:%M')} from {len(runs)} runs."]
    hb: list[str] = [f"<h1>{html.escape(title)}</h1>",
                     f"<p>Generated {time.strftime('%Y-%m-%d %H:%M')} from {len(runs)} runs.</p>"]
    if intro:
        md += ["", intro]
        hb.append(f"<p>{html.escape(intro)}</p>")
    unfinished = [r["name"] for r in runs if not r["finished"]]
    if unfinished:
        note = f"Unfinished runs (left out of the final metrics): {', '.join(unfinished)}."
        md += ["", note]
        hb.append(f"<p>{html.escape(note)}</p>")
    for recipe, groups in summary.items():
        header, rows = _table_rows(recipe, groups)
        md += ["", f"## {recipe}", "", _md_table(header, rows), ""]
        hb += [f"<h2>{html.escape(recipe)}</h2>", _html_table(header, rows)]
        note = ("Geometry columns: the last transformer block, measured on held-out data "
                "(`lapheads analyze`); mean ± std over seeds.")
        md.append(note)
        hb.append(f"<p>{html.escape(note)}</p>")
        makers = [("curves", _fig_curves, "training loss per step"),
                  ("metric", _fig_metric, "final metric per Laplacian-head setting (dots: seeds)"),
                  ("layers", _fig_layers, "token geometry per layer"),
                  ("spectra", _fig_spectra, "per-sequence spectrum of the last block")]
        for name, fn, caption in makers:
            p = fn(groups, figs / f"{recipe}_{name}.png", recipe)
            if p is not None:
                _add_fig(md, hb, p, out, f"{recipe}: {caption}")
        if recipe in ("classify", "dino"):  # vision runs; a language model has no patch tokens
            p = _fig_pca(groups, figs / f"{recipe}_pca.png", recipe)
            if p is not None:
                _add_fig(md, hb, p, out, f"{recipe}: PCA maps of patch tokens (top 3 components as RGB)")
    cl = claims(summary)
    if cl:
        md += ["", "## The paper's claims, checked on these runs", ""]
        hb.append("<h2>The paper's claims, checked on these runs</h2>")
        for head, text in cl:
            md += [f"**{head}.** {text}", ""]
            hb.append(f"<div class='claim'><b>{html.escape(head)}</b>{html.escape(text)}</div>")
    md += ["", "## Runs", ""]
    run_rows = [[r["name"], r["recipe"], r["label"], str(r["seed"]),
                 ", ".join(f"{k}={v:.4g}" for k, v in r["final"].items() if isinstance(v, (int, float)))]
                for r in runs]
    md.append(_md_table(["run", "recipe", "Laplacian heads", "seed", "final metrics"], run_rows))
    hb += ["<h2>Runs</h2>", _html_table(["run", "recipe", "Laplacian heads", "seed", "final metrics"], run_rows)]
    (out / "report.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>{''.join(hb)}{_IMG_CHECK}</body></html>")
    (out / "report.html").write_text(page, encoding="utf-8")
    (out / "summary.json").write_text(json.dumps(
        {rec: {lb: {k: v for k, v in g.items() if k != "runs"} | {"runs": [r["name"] for r in g["runs"]]}
               for lb, g in groups.items()} for rec, groups in summary.items()}, indent=1, default=str))
    return {"md": out / "report.md", "html": out / "report.html", "summary": out / "summary.json"}


def _add_fig(md: list[str], hb: list[str], path: Path, out: Path, caption: str) -> None:
    rel = path.relative_to(out).as_posix()
    md.append(f"![{caption}]({rel})")
    data = base64.b64encode(path.read_bytes()).decode()
    hb.append(f"<figure><img alt='{html.escape(caption)}' src='data:image/png;base64,{data}'>"
              f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="lapheads report",
                                description="Markdown + HTML report comparing runs, grouped by Laplacian heads.")
    p.add_argument("runs", nargs="+", help="run directories (finished `lapheads train ...` runs)")
    p.add_argument("--out", default="report", help="output directory (report.md, report.html, figures/)")
    p.add_argument("--title", default="lapheads report")
    p.add_argument("--analyze", action="store_true",
                   help="run the geometry analysis of runs that have none yet")
    args = p.parse_args(list(argv or []))
    from .outputs import check_out_dir, removed_on_failure
    check_out_dir(args.out)
    dirs = [Path(d) for d in args.runs]
    for d in dirs:
        if not (d / "config.yaml").is_file():
            raise ConfigError(f"{d} is not a run directory (no config.yaml)")
    from .engine.run import lock_dir, lock_enclosing_run  # one writer per run directory
    if args.analyze:
        from .geometry.runs import analyze_run
        for d in dirs:
            if not (d / "geometry" / "geometry.json").is_file() and (d / "final" / "model.json").is_file():
                with lock_dir(d):
                    analyze_run(d)
    with lock_enclosing_run(args.out), removed_on_failure(args.out):  # a failed report leaves no figures behind
        paths = build_report(dirs, args.out, title=args.title)
    print(f"report: {paths['md']}\n        {paths['html']}")
    return 0
