"""``lapheads quickstart``: baseline vs Laplacian heads on data that needs no download, with a report.

An honest small experiment, not a demo: the full plan gives every setting 3 seeds and trains every
run until its validation metric stops moving, and the report gives each difference from k=0 with
its 95% confidence interval, Welch's t and p, plus a plateau flag per run. The report states what
was run from the runs themselves (``--tiny``: 2 seeds and a few steps, so no verdicts).

1. Vision: the digits recipe (the shipped ``classify/digits`` config: a 4-layer, 4-head, 64-wide ViT on
   scikit-learn's embedded 8x8 digits) for k = 0 and k = all Laplacian heads per layer, 3 seeds
   each, 20 epochs (cosine schedule), evaluated every 2 epochs. The scaling study
   (``studies/scaling``) found this length at or near a plateau for this width. Fewer, longer
   runs: k = half is left to ``lapheads sweep`` (the time budget is 10 minutes with set-up).
2. Language: the tiny NanoChat-style recipe (the shipped ``lm/tiny`` config) on Python's embedded
   ``pydoc_data.topics`` corpus, shrunk to 2 layers x 64 wide so it converges in the time budget,
   for k = 0 and k = all, 3 seeds each, with a constant learning rate until validation bits per
   byte did not improve for 3 evaluations in a row (``train.until_plateau``; 0.46 M characters
   are overfitted within about two passes, so "until plateau" is where validation is best).
3. The token-geometry analysis of every run (ANOVA, Neural Collapse, spectra, cosine).
4. ``OUT/report/report.md`` and a self-contained ``OUT/report/report.html``, with a paragraph on
   what toy scale can and cannot say (:data:`SCOPE`).

Runs train ``--jobs`` at a time (default: one per core, up to 4), each in its own process with the
cores shared out (:func:`lapheads.sweep.run_grid`). Every run is an ordinary run directory under
``OUT/vision`` and ``OUT/lm`` (made by the same ``lapheads train`` commands and the same sweep as
``lapheads sweep``), so the quickstart is resumable: run it again and finished runs are skipped.
Like the sweep it never reuses a run made with other settings (e.g. a ``--tiny`` run where the
full one is asked for): it stops and says so, and ``--overwrite`` starts afresh. It holds the lock
of ``OUT`` while it runs (engine.run.RunLock). ``--tiny`` runs the same pipeline with a handful of
steps (for tests, under a minute).
"""

from __future__ import annotations

from pathlib import Path

# Run lengths: the full quickstart takes ~6 minutes on 2 idle CPU cores (README); --tiny under a minute.
# Every run evaluates along the way (train.eval_every) so the report has validation curves and
# plateau flags (three or more eval points per run).
_LM_SMALL = ["model.width=64", "model.depth=2", "model.n_heads=2", "data.total_batch_tokens=2048"]
PLAN = {
    "full": {
        "vision_heads": ["0", "all"],
        "vision_seeds": [0, 1, 2],
        "vision_set": ["data.epochs=20", "train.eval_every=44"],
        "lm_heads": ["0", "all"],
        "lm_seeds": [0, 1, 2],
        "lm_set": _LM_SMALL
        + [
            "train.schedule=constant",
            "train.max_steps=600",
            "train.eval_every=25",
            "train.until_plateau.patience=3",
            "train.until_plateau.metric=val_bpb",
            "train.until_plateau.mode=min",
        ],
        "max_items": 359,
    },
    "tiny": {
        "vision_heads": ["0", "all"],
        "vision_seeds": [0, 1],
        "vision_set": ["data.epochs=1", "train.max_steps=6", "data.max_eval_items=64", "train.eval_every=2"],
        "lm_heads": ["0", "all"],
        "lm_seeds": [0, 1],
        "lm_set": _LM_SMALL
        + ["train.max_steps=4", "train.eval_every=0", "data.eval_tokens=2048", "samples.max_new_tokens=4"],
        "max_items": 32,
    },
}

SCOPE = (
    "**What this can and cannot say.** Each section below states what was run, from the runs "
    "themselves: the seeds per setting, the optimizer steps, and which runs plateaued or stayed at "
    "chance. A comparison with k=0 gives an observed / opposite verdict only where each setting has "
    "at least 3 seeds and no compared run is at chance; every difference comes with its 95% "
    'confidence interval and Welch\'s p, and "not resolved" means exactly that, not "no '
    'effect". Where runs plateaued above chance the numbers hold for these models on these data '
    "only: a 4-layer, 64-wide ViT on 8x8 digits and a 2-layer, 64-wide language model on 0.46 M "
    "characters of Python documentation. They cannot say what the paper's claims rest on: ViTs "
    "and LMs of tens of millions of parameters or more trained on ImageNet or billions of tokens, "
    "where width, depth, data and training length change token geometry in ways runs this small "
    "do not show. A gap here, or its absence, is not evidence for or against Laplacian heads at "
    "scale; `studies/scaling/` measures how it moves with width and training length at toy scale."
)


def recipes_dir() -> Path:
    """The folder of the shipped recipe configs (``<group>/<name>.yaml``, :mod:`lapheads.recipes.shipped`)."""
    from .recipes.shipped import CONFIG_DIR

    return CONFIG_DIR
