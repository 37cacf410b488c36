"""The runs a report compares, read back as plain dicts (:func:`collect_run`): final metrics, curves,
geometry, plateau and chance flags, grid points, and the mean ± std over seeds per setting."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ..engine.run import RESUME_MUTABLE, RunDir, flatten_config
from ..heads import LaplacianHeads
from ..outputs import read_json
from ..recipes import Metric, get_recipe
from ..runs import load_geometry
from ..stats import Plateau, at_chance, plateau
from ..variants import variant_label

# geometry numbers summarised in the table: (summary key, layer, section, field, label); layer "last"
# is the last transformer block, "classifier" the classifier's input (meta.classifier_layer, pre_logits
# or the last block)
GEOMETRY = [
    ("anova.frac_within_sequence", "last", "anova", "frac_within_sequence", "within-seq frac"),
    ("anova.frac_between_class", "last", "anova", "frac_between_class", "between-class frac"),
    ("spectra.k_mean", "last", "spectra", "k_mean", "k99"),
    ("cosine.cosine_mean", "last", "cosine", "cosine_mean", "cosine"),
    ("nc_sequence_means.nc1", "last", "nc_sequence_means", "nc1", "NC1 (seq means)"),
    ("classifier_input.nc1", "classifier", "nc_tokens", "nc1", "NC1 (classifier input)"),
    ("nc_tokens.cdnv", "last", "nc_tokens", "cdnv", "CDNV (tokens)"),
]
_GEO = {key: (where, section, field) for key, where, section, field, _ in GEOMETRY}


def metrics_of(recipe: str) -> tuple[Metric, ...]:
    """The metrics the report compares for ``recipe`` (:attr:`lapheads.recipes.Recipe.metrics`)."""
    return get_recipe(recipe).metrics


def main_metric(recipe: str) -> Optional[Metric]:
    """The recipe's validation metric of the curves and plateau flags (the first of its metrics)."""
    metrics = metrics_of(recipe)
    return metrics[0] if metrics else None


def collect_run(run_dir: Path) -> dict[str, Any]:
    """One run as the report reads it: name, recipe, head label, seed, final metrics, training and
    validation records, whether it finished, its plateau stop, geometry and chance levels."""
    run = RunDir(run_dir)
    cfg = run.read_config()
    recipe = get_recipe(cfg["recipe"])
    label = LaplacianHeads(recipe.heads(run.path)).label()  # the recipe's one rule (SFT: its pretraining run's)
    # another attention (diff, xsa) is its own group; standard attention is k=0
    label = variant_label((cfg.get("model") or {}).get("attention", "laplacian"), "k=0" if label == "none" else label)
    final = run.final_dir / "metrics.json"
    records = run.metrics()
    finished = (run.final_dir / "model.json").is_file()
    return {
        "dir": str(run.path),
        "name": run.path.name,
        "recipe": cfg["recipe"],
        "label": label,
        "seed": (cfg.get("train") or {}).get("seed", 0),
        "final": read_json(final, "the final metrics of a run") if final.is_file() else {},
        "finished": finished,
        "train": [r for r in records if "loss" in r and r.get("split") is None],
        "val": [r for r in records if r.get("split") == "val"],
        "plateau_stop": next((r["step"] for r in records if r.get("event") == "until_plateau_stop"), None),
        "geometry": load_geometry(run.path),
        "chance": recipe.chance(run.path) if finished else {},
    }


def last_block(geo: dict) -> Optional[str]:
    """The name of the last transformer block in a geometry result (``pre_logits`` is not one)."""
    names = [n for n in geo.get("layers", {}) if n != "pre_logits"]
    return names[-1] if names else None


def _classifier_layer(geo: dict) -> Optional[str]:
    layer = (geo.get("meta") or {}).get("classifier_layer")
    if layer in geo.get("layers", {}):
        return layer
    return "pre_logits" if "pre_logits" in geo.get("layers", {}) else last_block(geo)


def geo_value(geo: Optional[dict], layer: Optional[str], section: str, key: str) -> Optional[float]:
    """A finite number of one layer's geometry section, or None."""
    if not geo or layer is None:
        return None
    v = geo["layers"].get(layer, {}).get(section, {}).get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def last_block_value(geo: Optional[dict], section: str, key: str) -> Optional[float]:
    """:func:`geo_value` of the last transformer block."""
    return geo_value(geo, last_block(geo) if geo else None, section, key)


def run_value(run: dict, key: str) -> Optional[float]:
    """One run's number for a summary key: a final metric or a geometry key of :data:`GEOMETRY`."""
    if key in _GEO:
        where, section, field = _GEO[key]
        geo = run["geometry"] or {}
        return geo_value(geo, last_block(geo) if where == "last" else _classifier_layer(geo), section, field)
    v = run["final"].get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def run_plateau(run: dict, window: float = 0.2, tol: float = 0.01) -> Plateau:
    """Plateau flag of a run's validation curve of its recipe's main metric (:func:`lapheads.stats.plateau`)."""
    m = main_metric(run["recipe"])
    pts = [(r["step"], r[m.key]) for r in run["val"] if m and isinstance(r.get(m.key), (int, float))]
    mode = None if m is None else ("max" if m.higher_is_better else "min")
    return plateau([s for s, _ in pts], [v for _, v in pts], window, tol, stopped_at=run.get("plateau_stop"), mode=mode)


def run_at_chance(run: dict) -> Optional[str]:
    """Why a finished run is at chance (its first metric with a chance level is no better than a
    guess, :func:`lapheads.stats.at_chance`), or None."""
    for m in metrics_of(run["recipe"]):
        level, value = run["chance"].get(m.key), run_value(run, m.key)
        if level is None or value is None:
            continue
        n = run["final"].get("n")
        n = n if isinstance(n, int) and not isinstance(n, bool) else None
        if at_chance(value, level, m.higher_is_better, n):
            return f"{m.label} {num(value)}, chance {num(level)}"
        return None
    return None


def mean_std(xs: Sequence[Optional[float]]) -> tuple[float, float, int]:
    """(mean, sample std, n) of the finite values; (nan, nan, 0) without any."""
    a = np.asarray([x for x in xs if x is not None and math.isfinite(x)], dtype=float)
    if a.size == 0:
        return float("nan"), float("nan"), 0
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0, int(a.size)


def num(x: Any, digits: int = 4) -> str:
    """A number for people: integers (and integral values) in full (``10000``, never ``1e+04``),
    other values to ``digits`` significant digits, large ones rounded to an integer."""
    if isinstance(x, int):  # bools too
        return str(x)
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    if abs(x) < 1e15 and (x.is_integer() or abs(x) >= 10**digits):
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def fmt(m: float, s: float, n: int, digits: int = 4) -> str:
    """``mean ± std`` (one value alone for n = 1, ``-`` without data)."""
    if n == 0 or not math.isfinite(m):
        return "-"
    return f"{num(m, digits)} ± {num(s, 2)}" if n > 1 else num(m, digits)


def summarise(runs: list[dict]) -> dict[str, dict[str, dict[str, Any]]]:
    """recipe -> label -> {"runs": [...], metric/geometry key -> (mean, std, n)}."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(r["recipe"], {}).setdefault(r["label"], {"runs": []})["runs"].append(r)
    for recipe, groups in out.items():
        for g in groups.values():
            for key in [m.key for m in metrics_of(recipe)] + [k for k, *_ in GEOMETRY]:
                g[key] = mean_std([run_value(r, key) for r in g["runs"]])
        out[recipe] = dict(sorted(groups.items(), key=lambda kv: LaplacianHeads.sort_key(kv[0])))
    return out


# keys that never define a grid axis: the k and seed axes, and what does not change the math
_NOT_AXES = {"model.laplacian_heads", "laplacian_heads", "model.attention", "train.seed"} | (
    RESUME_MUTABLE - {"train.max_steps"}
)


def by_recipe(runs: Sequence[dict]) -> dict[str, list[dict]]:
    """The runs of each recipe, in order."""
    out: dict[str, list[dict]] = {}
    for r in runs:
        out.setdefault(r["recipe"], []).append(r)
    return out


def grid_axes(configs: Sequence[dict]) -> list[str]:
    """Config keys whose values differ between runs (of one recipe): the grid axes of a sweep."""
    flats = [flatten_config(c) for c in configs]
    keys = sorted(set().union(*flats)) if flats else []
    return [k for k in keys if k not in _NOT_AXES and len({repr(f.get(k)) for f in flats}) > 1]


def numeric(values: Sequence[Any]) -> bool:
    """Whether every value is a number (bools are not)."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def axis_order(values: Sequence[Any]) -> tuple:
    """A sort key for grid-axis values: numbers in order, then texts."""
    return tuple((0, v, "") if numeric([v]) else (1, 0, str(v)) for v in values)


def grid_points(runs: Sequence[dict]) -> dict[str, list[dict]]:
    """The runs of ONE recipe by grid point (one combination of :func:`grid_axes`, named
    ``"embed_dim=32, epochs=5"``; ``""`` without axes), in axis order."""
    configs = [RunDir(r["dir"]).read_config() for r in runs]
    axes = grid_axes(configs)
    points: dict[tuple, list[dict]] = {}
    for r, c in zip(runs, configs):
        f = flatten_config(c)
        points.setdefault(tuple(f.get(a) for a in axes), []).append(r)
    order = sorted(points, key=axis_order)
    return {", ".join(f"{a.rsplit('.', 1)[-1]}={v}" for a, v in zip(axes, values)): points[values] for values in order}
