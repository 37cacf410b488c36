"""``lapheads quickstart``: baseline vs Laplacian heads on data that needs no download, with a report.

1. Vision: the digits recipe (``recipes/classify/digits.yaml``: a 4-layer, 4-head ViT on
   scikit-learn's embedded 8x8 digits) for k = 0, k = half and k = all Laplacian heads per
   layer, 3 seeds each.
2. Language: the tiny NanoChat-style recipe (``recipes/lm/tiny.yaml``) on Python's embedded
   ``pydoc_data.topics`` corpus for the same k values.
3. The token-geometry analysis of every run (ANOVA, Neural Collapse, spectra, cosine).
4. ``OUT/report/report.md`` and a self-contained ``OUT/report/report.html``.

Every run is an ordinary run directory under ``OUT/vision`` and ``OUT/lm`` (made by the same
``lapheads train`` commands and the same sweep as ``lapheads sweep``), so the quickstart is
resumable: run it again and finished runs are skipped. Like the sweep it never reuses a run made
with other settings (e.g. a ``--tiny`` run where the full one is asked for): it stops and says so,
and ``--overwrite`` starts afresh. It holds the lock of ``OUT`` while it runs (engine.run.RunLock).
``--tiny`` runs the same pipeline with a handful of steps (for tests, under a minute).
"""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError

# Run lengths: the full quickstart fits in ~10 minutes on 2 CPU cores; --tiny in under a minute.
# Vision runs evaluate along the way (train.eval_every) so the report has validation curves and
# plateau flags (three or more eval points per run).
PLAN = {
    "full": {"vision_seeds": [0, 1, 2], "lm_seeds": [0],
             "vision_set": ["data.epochs=10", "train.eval_every=25"], "lm_set": ["train.max_steps=120", "train.eval_every=40"],
             "max_items": 359},
    "tiny": {"vision_seeds": [0, 1], "lm_seeds": [0],
             "vision_set": ["data.epochs=1", "train.max_steps=6", "data.max_eval_items=64", "train.eval_every=2"],
             "lm_set": ["train.max_steps=4", "train.eval_every=0", "data.eval_tokens=2048",
                        "samples.max_new_tokens=4"],
             "max_items": 32},
}


def recipes_dir() -> Path:
    """The ``recipes/`` folder of the source checkout this package runs from."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent / "recipes"
        if (cand / "classify" / "digits.yaml").is_file():
            return cand
    raise ConfigError(
        "the quickstart needs the recipes/ folder of a lapheads source checkout (install with "
        "`pip install -e .` from the repository, or run `make quickstart`)")
