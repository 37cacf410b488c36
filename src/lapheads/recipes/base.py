"""The recipe contract: the base class every recipe subclasses, and what recipes share.

What each member is for: docs/design/recipes.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, NamedTuple, Optional

import torch
from torch import nn

from ..engine import DistInfo, TrainTask
from ..engine.config import from_dict
from ..engine.launch import launch
from ..engine.run import RunDir
from ..engine.trackers import Table
from ..errors import CheckpointError, LapheadsError
from ..heads import LaplacianHeads, mixing_table
from ..outputs import read_json


class Metric(NamedTuple):
    """A number a recipe's evaluation logs (``final/metrics.json``, ``metrics.jsonl``); unpacks as
    ``key, label, higher_is_better``.

    Attributes:
        key: its key in the logged records (``top1``, ``val_bpb``).
        label: how the report and the help name it (``top-1 acc``).
        higher_is_better: its direction (accuracy: True; loss, bits per byte: False).
    """

    key: str
    label: str
    higher_is_better: bool

    def describe(self) -> str:
        return f"{self.key} ({self.label}, {'higher' if self.higher_is_better else 'lower'} is better)"


@dataclass
class LoadedRun:
    """A finished run read back by its recipe.

    Attributes:
        recipe: the recipe's name.
        path: the run directory.
        config: the run's typed config (the recipe's ``config_type``).
        model: the network the run is evaluated with (classify: the classifier; dino: the teacher
            backbone; lm / sft / retrofit: the transformers causal LM), in eval mode.
        kind: ``"vit"`` or ``"hf"`` (see :func:`lapheads.geometry.analyze_model`).
        tokenizer: language runs: the tokenizer.
        transform: vision runs: the evaluation transform (PIL image -> normalised tensor).
        analyze_options: keyword arguments for :func:`lapheads.geometry.analyze_model` that this
            recipe's models need (``num_classes`` of a language model, ``classifier=None``, ...).
    """

    recipe: str
    path: Path
    config: Any
    model: nn.Module
    kind: str
    tokenizer: Any = None
    transform: Any = None
    analyze_options: dict = field(default_factory=dict)


def vision_batches(dataset: Any, transform: Any, batch_size: int, max_items: int) -> list:
    """A fixed subset (the first ``max_items`` of a seeded permutation) as ``(images, labels)`` batches."""
    n = min(len(dataset), max_items) if max_items else len(dataset)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))[:n].tolist()
    chunks = [[dataset[i] for i in order[s : s + batch_size]] for s in range(0, n, batch_size)]
    return [
        (torch.stack([transform(img) for img, _ in c]), torch.as_tensor([y for _, y in c], dtype=torch.long))
        for c in chunks
    ]


def with_ema(measure: Callable[[nn.Module], dict], model: nn.Module, ema_model: Optional[nn.Module], keys=None) -> dict:
    """``measure(model)``, plus ``ema_<key>`` of ``measure(ema_model)`` (only ``keys``, when given) with an EMA."""
    out = measure(model)
    if ema_model is not None:
        out.update({f"ema_{k}": v for k, v in measure(ema_model).items() if keys is None or k in keys})
    return out


def read_model_json(run_dir: str | Path, missing: str, what: str, valid: Callable[[Any], bool], damaged: str) -> Any:
    """``RUN/final/model.json``, checked by ``valid``.

    Raises:
        CheckpointError: ``"{path} does not exist; {missing}"`` or ``"{path} {damaged}"`` (``valid`` is False).
    """
    path = Path(run_dir) / "final" / "model.json"
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; {missing}")
    spec = read_json(path, what)
    if not valid(spec):
        raise CheckpointError(f"{path} {damaged}")
    return spec


class HeadsTask(TrainTask):
    """The engine :class:`~lapheads.engine.TrainTask` of a recipe whose models carry Laplacian heads: with
    learnable mixing, every evaluation also logs ``lap_mix`` (per layer: ``a``, ``b`` and the
    Laplacian-ness of each head, :func:`lapheads.heads.mixing_table`), which the report plots."""

    def extra_metrics(self, model: nn.Module) -> dict[str, Any]:
        mix = mixing_table(model)
        return {"lap_mix": mix} if mix else {}

    def tables(self) -> dict[str, Table]:
        return {"lap_mix": Table(["layer", "head", "a", "b", "laplacianness"], mixing_rows)}


def mixing_rows(table: list[dict[str, Any]]) -> list[list[Any]]:
    """The rows ``[layer, head, a, b, laplacianness]`` of a ``lap_mix`` table (:func:`lapheads.heads.mixing_table`)."""
    return [
        [row["layer"], h, a, b, ln]
        for row in table
        for h, (a, b, ln) in enumerate(zip(row["a"], row["b"], row.get("laplacianness") or [None] * len(row["a"])))
    ]


class Recipe(ABC):
    """Base class of every recipe (the contract: docs/design/recipes.md)."""

    name: ClassVar[str]
    config_type: ClassVar[type]
    task_type: ClassVar[Callable[..., TrainTask]]
    kind: ClassVar[str]
    description: ClassVar[str] = ""
    default_config: ClassVar[Optional[str]] = None
    metrics: ClassVar[tuple[Metric, ...]] = ()  # the first is the main metric
    #: the config key of the head setting a sweep's ``--laplacian-heads`` axis sets
    heads_key: ClassVar[str] = "model.laplacian_heads"

    def chance(self, run_dir: str | Path) -> dict[str, float]:
        """``{metric key: value of a model that guesses}`` for the finished run in ``run_dir``
        (classify: ``1 / classes`` top-1); empty where the recipe defines no chance level."""
        return {}

    def build_task(self, cfg: Any, info: DistInfo, run_dir: Optional[str | Path] = None) -> TrainTask:
        """The engine task for ``cfg``, a ``task_type`` (``run_dir``: where the run writes, for tasks that log files)."""
        return self.task_type(cfg, info, run_dir=run_dir)

    def train(
        self, cfg: Any, out: str | Path, *, resume: bool = False, overwrite: bool = False, reevaluate: bool = False
    ) -> dict:
        """Train ``cfg`` into run directory ``out``; returns the final metrics (``reevaluate``: a
        resumed run that had finished evaluates its final model again instead of reusing the logged
        evaluation)."""
        return launch(
            self.name,
            cfg,
            lambda c, info: self.build_task(c, info, run_dir=out),
            str(out),
            resume=resume,
            overwrite=overwrite,
            same=self.same_setting,
            reevaluate=reevaluate,
        )

    def finished(self, cfg: Any, out: str | Path) -> bool:
        """Whether training ``cfg`` into ``out`` has nothing left to do: the run wrote ``final/``."""
        return (RunDir(out).final_dir / "model.json").is_file()

    def final_result(self, out: str | Path) -> dict:
        """What :meth:`train` returned for the finished run in ``out``: its final metrics."""
        path = RunDir(out).final_dir / "metrics.json"
        return read_json(path, "the final metrics of a run") if path.is_file() else {}

    def same_setting(self, key: str, old: Any, new: Any) -> bool:
        """The run-equality rule (``--resume``, sweeps): equal values, and for a ``laplacian_heads``
        key equal head settings (``None``, ``"none"`` and ``0`` are one)."""
        if old == new:
            return True
        if key.rsplit(".", 1)[-1] != "laplacian_heads":
            return False
        try:
            a, b = LaplacianHeads(old), LaplacianHeads(new)
        except LapheadsError:
            return False
        no_heads = [h.kind == "none" or (h.kind == "k" and h.spec == 0) for h in (a, b)]
        return a == b or all(no_heads)

    def result_lines(self, result: dict, out: str | Path) -> list[str]:
        """What ``lapheads train <name>`` prints when :meth:`train` returns ``result``."""
        final = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items())
        return ([f"final: {final}"] if result else []) + [f"run directory: {out}"]

    def read_config(self, run_dir: str | Path) -> Any:
        """The typed config of a run of this recipe (its ``config.yaml``)."""
        raw = RunDir(run_dir).read_config()
        if raw.pop("recipe") != self.name:
            raise CheckpointError(f"{run_dir} is not a `{self.name}` run")
        return from_dict(self.config_type, raw, prefix=f"{Path(run_dir) / 'config.yaml'}: ")

    def heads(self, run_dir: str | Path) -> Any:
        """The Laplacian-head setting of a run as written in its config (``model.laplacian_heads``)."""
        return (RunDir(run_dir).read_config().get("model") or {}).get("laplacian_heads", 0)

    def loaded(self, run_dir: str | Path, config: Any, model: nn.Module, **kw: Any) -> LoadedRun:
        """The :class:`LoadedRun` of this recipe's run ``run_dir`` (``kw``: its optional fields)."""
        return LoadedRun(self.name, Path(run_dir), config, model, self.kind, **kw)

    @abstractmethod
    def load_run(self, run_dir: str | Path, weights: str = "model", device: Any = "cpu") -> LoadedRun:
        """A finished run's model and everything needed to feed it (see :class:`LoadedRun`)."""

    def eval_dataset(self, config: Any) -> Any:
        """The held-out images of a vision run's config (``(image, label)`` items)."""
        raise CheckpointError(f"a `{self.name}` run has no images")

    def eval_batches(self, run: LoadedRun, *, max_items: int, batch_size: int, seq_len: Optional[int] = None) -> list:
        """Held-out batches of ``run`` for :func:`lapheads.geometry.analyze_model` (vision: a fixed,
        seeded subset of :meth:`eval_dataset` through the run's evaluation transform)."""
        return vision_batches(self.eval_dataset(run.config), run.transform, batch_size, max_items)

    def load_backbone(self, run_dir: str | Path, device: Any = "cpu") -> tuple[nn.Module, dict]:
        """A frozen vision backbone of the run and its metadata (:mod:`lapheads.vision.backbones`)."""
        raise CheckpointError(
            f"{run_dir} is a `{self.name}` run (a language model): probes and PCA maps need a "
            "vision backbone, a `classify` or `dino` run or --model NAME; use `lapheads analyze "
            "--run` for the token geometry of a language model"
        )
