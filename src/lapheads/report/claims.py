"""The paper's claims checked on the runs: every Laplacian-head setting against k=0, per recipe and
per grid point, with Welch's test over seeds; no verdict with fewer than
:data:`lapheads.stats.MIN_SEEDS` seeds per setting or with a compared run at chance."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..stats import Comparison, Plateau, compare
from .collect import by_recipe, grid_points, main_metric, run_plateau, run_value, summarise

# (summary key, the claim predicts lower values with Laplacian heads, claim, how it is measured)
CLAIMS = [
    (
        "anova.frac_within_sequence",
        True,
        "Laplacian heads shrink the within-sequence variance",
        "within-sequence fraction of the token variance, last block",
    ),
    (
        "anova.frac_between_class",
        False,
        "Laplacian heads grow the between-class variance",
        "between-class fraction of the token variance, last block",
    ),
    (
        "spectra.k_mean",
        True,
        "Laplacian heads make spectra decay faster (lower k99)",
        "components for 99% of a sequence's variance, last block",
    ),
    (
        "nc_tokens.cdnv",
        True,
        "Laplacian heads make classes more separable (lower CDNV)",
        "CDNV of tokens by class (next token for a language model), last block",
    ),
    (
        "nc_sequence_means.nc1",
        True,
        "Laplacian heads strengthen neural collapse of image/sequence means (lower NC1)",
        "NC1 = tr(Sigma_W pinv(Sigma_B)) / C of the image (sequence) means by class, last block",
    ),
    (
        "classifier_input.nc1",
        True,
        "Laplacian heads strengthen neural collapse at the classifier input (lower NC1)",
        "NC1 of the features the classifier reads (pre-logits for a ViT; the last hidden state's tokens by "
        "next token for a language model)",
    ),
]


def comparisons(groups: dict, key: str, want_lower: bool) -> list[Comparison]:
    """Every setting with data against the baseline k=0 (none without a baseline); the verdict of a
    comparison that involves runs at chance is withheld."""
    if "k=0" not in groups:
        return []
    base = [run_value(r, key) for r in groups["k=0"]["runs"]]
    out = []
    for label, g in groups.items():
        if label == "k=0":
            continue
        c = compare("k=0", base, label, [run_value(r, key) for r in g["runs"]], want_lower)
        runs = groups["k=0"]["runs"] + g["runs"]
        chance = [r["name"] for r in runs if r.get("at_chance")]
        if chance:
            c.withhold("at chance", f"{len(chance)} of {len(runs)} runs compared are at chance ({', '.join(chance)})")
        if c.verdict != "no data":
            out.append(c)
    return out if any(c.n_baseline for c in out) else []


def _convergence_note(groups: dict, labels: Sequence[str], flags: dict[str, Plateau]) -> str:
    """Empty when every compared run had plateaued, else which had not (or are unknown)."""
    runs = [r for lb in labels for r in groups[lb]["runs"]]
    no = [r["name"] for r in runs if flags[r["dir"]].status == "no"]
    unknown = [r["name"] for r in runs if flags[r["dir"]].status == "unknown"]
    parts = []
    if no:
        parts.append(
            f"{len(no)} of {len(runs)} runs compared had not plateaued ({', '.join(no)}): "
            "this compares unconverged runs"
        )
    if unknown:
        parts.append(
            f"convergence unknown for {len(unknown)} of {len(runs)} runs (fewer than 3 validation "
            "points; set train.eval_every)"
        )
    return "; ".join(parts)


def claims(summary: dict, flags: Optional[dict[str, Plateau]] = None) -> list[dict[str, Any]]:
    """One entry per (recipe, claim) with data: ``{"recipe", "key", "claim", "how", "want_lower",
    "comparisons": [Comparison], "convergence": str, "text": str}``."""
    if flags is None:
        flags = {r["dir"]: run_plateau(r) for gs in summary.values() for g in gs.values() for r in g["runs"]}
    out = []
    for recipe, groups in summary.items():
        spec = list(CLAIMS)
        m = main_metric(recipe)
        if m is not None:
            what = (
                "Laplacian heads raise the accuracy" if m.higher_is_better else f"Laplacian heads lower the {m.label}"
            )
            spec.append((m.key, not m.higher_is_better, what, m.label))
        for key, lower, what, how in spec:
            comps = comparisons(groups, key, lower)
            if not comps:
                continue
            conv = _convergence_note(groups, ["k=0"] + [c.other for c in comps], flags)
            text = f"{how[0].upper() + how[1:]}. " + "; ".join(c.describe() for c in comps) + "."
            if conv:
                text += f" Convergence: {conv}."
            out.append(
                {
                    "recipe": recipe,
                    "key": key,
                    "claim": f"{recipe}: {what}",
                    "how": how,
                    "want_lower": lower,
                    "comparisons": comps,
                    "convergence": conv,
                    "text": text,
                }
            )
    return out


def grid_claims(runs: Sequence[dict], flags: dict[str, Plateau]) -> list[dict[str, Any]]:
    """:func:`claims` inside each grid point (runs that differ only in k and seed), for every recipe
    with several points; each entry's ``claim`` names its point, also in ``"point"``."""
    out: list[dict[str, Any]] = []
    for recipe, rs in by_recipe(runs).items():
        points = grid_points(rs)
        if len(points) < 2:
            continue
        for name, point_runs in points.items():
            for c in claims(summarise(point_runs), flags):
                c["claim"] = f"{recipe} at {name}: {c['claim'].split(': ', 1)[1]}"
                c["point"] = name
                out.append(c)
    return out
