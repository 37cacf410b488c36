"""``lapheads quickstart``: baseline vs Laplacian heads on data that needs no download, with a report.

:data:`PLAN` is what it trains: ``classify/digits`` and a shrunk ``lm/tiny``, k = 0 and k = all over seeds, as
resumable sweeps (:func:`lapheads.sweep.run_grid`) in ``OUT/vision`` and ``OUT/lm``; then the geometry of every
run and ``OUT/report/``, whose scope paragraph is :data:`SCOPE` (the plan's reasons: docs/design/recipes.md).
"""

from __future__ import annotations

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
