"""The recipe contract: what every recipe provides, enforced by a base class.

A recipe is a training task on the shared engine (:mod:`lapheads.engine`) plus the knowledge of
how to read back a run it made. Everything above the recipes (the train/eval commands, geometry
of runs, the report, the sweep, the probes) talks to a recipe through this class only, never
through ``if recipe == ...`` chains:

==================  ===========================================================================
``name``            the recipe's name (``lapheads train <name>``, ``recipe:`` in config.yaml)
``metrics``         the keys its evaluation logs that the report compares (:class:`Metric`; the first
                    is the main one: curves, plateau flags); ``chance`` their values for a model
                    that guesses, where a run directory tells them
``config_type``     its config, a pydantic model (:class:`lapheads.engine.config.ConfigModel`: types, ranges,
                    defaults, descriptions; parsed and validated by
                    :func:`lapheads.engine.config.load_config`, its JSON schema by ``lapheads config schema``;
                    an optional ``resume_mutable()`` method names keys a ``--resume`` may change)
``kind``            how the geometry toolkit reads its models: ``"vit"`` or ``"hf"``
``build_task``      the engine :class:`~lapheads.engine.TrainTask` for a config (a :class:`HeadsTask`: its
                    evaluations also log the learned head mixing, ``lap_mix``, which the
                    experiment trackers get as a table, one row per head)
``same_setting``    the run-equality rule of ``--resume`` and sweeps (two spellings of one head
                    setting are the same run)
``train``           run it into a directory (default: one engine launch)
``load_run``        a finished run's model, tokenizer / eval transform, heads: a :class:`LoadedRun`
``heads``           the run's Laplacian-head setting, read from the run directory (one rule)
``eval_dataset``    held-out images of a vision run (report figures)
``eval_batches``    held-out batches of a loaded run, for geometry
``load_backbone``   a frozen vision backbone of a run (probes, PCA maps); language recipes refuse
==================  ===========================================================================
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Optional

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
    batches = []
    for s in range(0, n, batch_size):
        items = [dataset[i] for i in order[s : s + batch_size]]
        batches.append(
            (
                torch.stack([transform(img) for img, _ in items]),
                torch.as_tensor([y for _, y in items], dtype=torch.long),
            )
        )
    return batches


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
    rows = []
    for row in table:
        lap = row.get("laplacianness") or [None] * len(row["a"])
        for h, (a, b, ln) in enumerate(zip(row["a"], row["b"], lap)):
            rows.append([row["layer"], h, a, b, ln])
    return rows


class Recipe(ABC):
    """Base class of every recipe (see the module docstring for the contract)."""

    name: ClassVar[str]
    config_type: ClassVar[type]
    kind: ClassVar[str]
    description: ClassVar[str] = ""
    default_config: ClassVar[Optional[str]] = None
    metrics: ClassVar[tuple[Metric, ...]] = ()  # the first is the main metric

    def chance(self, run_dir: str | Path) -> dict[str, float]:
        """``{metric key: value of a model that guesses}`` for the finished run in ``run_dir``
        (classify: ``1 / classes`` top-1); empty where the recipe defines no chance level."""
        return {}

    # ------------------------------------------------------------------ training
    @abstractmethod
    def build_task(self, cfg: Any, info: DistInfo, run_dir: Optional[str | Path] = None) -> TrainTask:
        """The engine task for ``cfg`` (``run_dir``: where the run writes, for tasks that log files)."""

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
        lines = (
            ["final: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items())]
            if result
            else []
        )
        return lines + [f"run directory: {out}"]

    # ------------------------------------------------------------------ reading runs back
    def read_config(self, run_dir: str | Path) -> Any:
        """The typed config of a run of this recipe (its ``config.yaml``)."""
        raw = RunDir(run_dir).read_config()
        if raw.pop("recipe") != self.name:
            raise CheckpointError(f"{run_dir} is not a `{self.name}` run")
        return from_dict(self.config_type, raw, prefix=f"{Path(run_dir) / 'config.yaml'}: ")

    def heads(self, run_dir: str | Path) -> Any:
        """The Laplacian-head setting of a run as written in its config (``model.laplacian_heads``)."""
        return (RunDir(run_dir).read_config().get("model") or {}).get("laplacian_heads", 0)

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
