"""Which heads of which layer are Laplacian.

The authors' convention (PAPER.md, "The operator"): the Laplacian heads are the TRAILING k heads
of a layer, and the same k is used in every layer. The LM code also takes a per-layer list.
:class:`LaplacianHeads` accepts all of these and validates them against a concrete model shape:

=====================================  ============================================
``LaplacianHeads(3)``                  trailing 3 heads of every layer
``LaplacianHeads("all")``              every head of every layer
``LaplacianHeads("none")`` / ``0``     no Laplacian head (the baseline)
``LaplacianHeads([0, 2, 4])``          per layer: trailing 0, 2, 4 heads
``LaplacianHeads([[0], [], [1, 3]])``  per layer: explicit head indices
``LaplacianHeads("learn")``            learnable mixing ``a_h I + b_h P``, every head
                                       starts standard (same as ``"learn:standard"``)
``LaplacianHeads("learn:laplacian")``  learnable, every head starts Laplacian
``LaplacianHeads("learn:3")``          learnable, the trailing 3 heads start Laplacian
``LaplacianHeads.learn(init)``         the same, ``init`` = "standard", "laplacian" or k
=====================================  ============================================

Learnable mixing (issue 13): a head's operator generalises to ``a_h I + b_h P`` with two learned
numbers per head per layer (a standard head is ``a=0, b=1``, a Laplacian head ``a=1, b=-1``). A
learnable selection is not a fixed set of heads: :meth:`LaplacianHeads.resolve_flags` refuses it,
:meth:`LaplacianHeads.init_flags` gives the heads that START Laplacian, and the modules that
accept it (:mod:`lapheads.nn`, :mod:`lapheads.timm`, :mod:`lapheads.transformers`) register the
parameters ``lap_mix_a`` / ``lap_mix_b`` (shape ``(n_heads,)``) on each attention layer. The
stateless operator takes them as a :class:`HeadMix`. Names end in ``lap_mix_a`` / ``lap_mix_b``
(:data:`MIX_PARAM_SUFFIXES`) so optimizers can exclude them from weight decay and from Muon.
:func:`mixing_table` reads them back from any model, :func:`suggest_selection` turns them into a
fixed selection (each head takes the nearer of the two fixed operators in the ``(a, b)`` plane).

``resolve(n_layers, n_heads)`` returns one boolean mask of shape ``(n_heads,)`` per layer. Every
invalid value raises :class:`lapheads.errors.ConfigError` (a ``ValueError``) that says what was
given and what is allowed.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence, Union

import torch

from .errors import ConfigError

HeadSpec = Union[int, str, Sequence[int], Sequence[Sequence[int]], "LaplacianHeads", None]

_ALLOWED = (
    "an int k >= 0 (trailing k heads of every layer), 'all', 'none', a per-layer list of ints, "
    "a per-layer list of head-index lists, or 'learn' / 'learn:standard' / 'learn:laplacian' / 'learn:<k>' "
    "(learnable mixing)"
)

#: Parameter-name suffixes of the learnable mixing (a, b); optimizers match on them.
MIX_PARAM_SUFFIXES: tuple[str, str] = ("lap_mix_a", "lap_mix_b")


class HeadMix(NamedTuple):
    """Per-head mixing ``a_h I + b_h P`` for the stateless operator: ``a`` and ``b`` of shape ``(H,)``.

    ``HeadMix(a=0, b=1)`` per head is a standard head, ``HeadMix(a=1, b=-1)`` a Laplacian head.
    Pass it as ``laplacian_heads=`` of :func:`lapheads.laplacian_attention` (gradients flow into
    ``a`` and ``b``).
    """

    a: torch.Tensor
    b: torch.Tensor


def _parse_learn(spec: str) -> Union[str, int]:
    """``"learn"``, ``"learn:standard"``, ``"learn:laplacian"``, ``"learn:<k>"`` -> the initialisation."""
    _, _, init = spec.partition(":")
    init = init.strip() or "standard"
    if init in ("standard", "laplacian"):
        return init
    if init.isdigit():
        return int(init)
    raise ConfigError(f"laplacian_heads={spec!r}: the learnable initialisation must be 'standard', 'laplacian' or "
                      f"an int k >= 0 (trailing k heads start Laplacian), e.g. 'learn:laplacian' or 'learn:2'")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class LaplacianHeads:
    """A validated description of the Laplacian heads of a model.

    Args:
        spec: ``int`` k, ``"all"``, ``"none"``, ``None`` (same as ``"none"``), a per-layer list of
            ints, a per-layer list of index lists, or another :class:`LaplacianHeads`.
    """

    def __init__(self, spec: HeadSpec = "none"):
        if isinstance(spec, LaplacianHeads):
            spec = spec.spec
        if spec is None:
            spec = "none"
        self.learn_init: Union[str, int, None] = None
        if isinstance(spec, str) and spec.strip().lower().split(":")[0].strip() == "learn":
            self.learn_init = _parse_learn(spec.strip().lower())
            self.kind = "learn"
            self.spec = f"learn:{self.learn_init}"
            return
        if isinstance(spec, str):
            s = spec.strip().lower()
            if s not in ("all", "none"):
                if s.lstrip("-").isdigit():
                    spec = int(s)
                else:
                    raise ConfigError(f"laplacian_heads={spec!r} is not understood; allowed: {_ALLOWED}")
            else:
                spec = s
        if _is_int(spec):
            if spec < 0:
                raise ConfigError(f"laplacian_heads={spec} is negative; allowed: {_ALLOWED}")
            self.kind = "k"
        elif isinstance(spec, str):
            self.kind = spec
        elif isinstance(spec, (list, tuple)):
            items = list(spec)
            if all(_is_int(x) for x in items):
                for i, x in enumerate(items):
                    if x < 0:
                        raise ConfigError(f"laplacian_heads[{i}]={x} is negative; per-layer counts must be >= 0")
                self.kind = "per_layer_k"
                spec = items
            elif all(isinstance(x, (list, tuple)) for x in items):
                for i, idx in enumerate(items):
                    for j in idx:
                        if not _is_int(j):
                            raise ConfigError(
                                f"laplacian_heads[{i}] contains {j!r}; head indices must be ints")
                        if j < 0:
                            raise ConfigError(f"laplacian_heads[{i}] contains negative head index {j}")
                    if len(set(idx)) != len(idx):
                        raise ConfigError(f"laplacian_heads[{i}]={list(idx)} has duplicate head indices")
                self.kind = "per_layer_indices"
                spec = [list(idx) for idx in items]
            else:
                raise ConfigError(
                    f"laplacian_heads={spec!r} mixes types; allowed: {_ALLOWED}")
        else:
            raise ConfigError(
                f"laplacian_heads={spec!r} has type {type(spec).__name__}; allowed: {_ALLOWED}")
        self.spec = spec

    @classmethod
    def learn(cls, init: Union[str, int] = "standard") -> "LaplacianHeads":
        """Learnable mixing ``a_h I + b_h P``; ``init``: "standard", "laplacian" or k (trailing k start Laplacian)."""
        if _is_int(init):
            if init < 0:
                raise ConfigError(f"LaplacianHeads.learn(init={init}): k must be >= 0")
            return cls(f"learn:{init}")
        if not isinstance(init, str):
            raise ConfigError(f"LaplacianHeads.learn(init={init!r}): init must be 'standard', 'laplacian' or an int k")
        return cls(f"learn:{init}")

    @property
    def learnable(self) -> bool:
        """True for learnable mixing (``"learn..."``): the modules hold parameters ``lap_mix_a/b``."""
        return self.kind == "learn"

    def init_flags(self, n_layers: int, n_heads: int) -> list[tuple[bool, ...]]:
        """For a learnable spec, the heads that START Laplacian (``a=1, b=-1``); the rest start standard.

        For a fixed spec this is :meth:`resolve_flags`.
        """
        if not self.learnable:
            return self.resolve_flags(n_layers, n_heads)
        init = self.learn_init
        spec = "all" if init == "laplacian" else ("none" if init == "standard" else init)
        return LaplacianHeads(spec).resolve_flags(n_layers, n_heads)

    # ------------------------------------------------------------------ resolution
    def resolve(self, n_layers: int, n_heads: int) -> list[torch.Tensor]:
        """Per-layer boolean masks (``True`` = Laplacian head), validated against the model shape."""
        return [torch.tensor(f, dtype=torch.bool) for f in self.resolve_flags(n_layers, n_heads)]

    def resolve_flags(self, n_layers: int, n_heads: int) -> list[tuple[bool, ...]]:
        """Like :meth:`resolve` but plain Python tuples of bools.

        Pure Python on purpose: branching on these never syncs an accelerator and stays a constant
        under ``torch.compile`` (branching on a tensor would be a data-dependent graph break).
        """
        if n_layers < 1 or n_heads < 1:
            raise ConfigError(f"model shape n_layers={n_layers}, n_heads={n_heads} must be positive")
        if self.kind == "learn":
            raise ConfigError(
                f"laplacian_heads={self.spec!r} is learnable mixing, not a fixed set of heads; it needs a module "
                "that holds the parameters (lapheads.nn.MultiheadAttention, lapheads.timm.convert, "
                "lapheads.transformers.enable) or a HeadMix(a, b) for the operator")
        if self.kind == "all":
            return [(True,) * n_heads for _ in range(n_layers)]
        if self.kind == "none":
            return [(False,) * n_heads for _ in range(n_layers)]
        if self.kind == "k":
            return [self._trailing(self.spec, n_heads, None) for _ in range(n_layers)]
        if len(self.spec) != n_layers:
            raise ConfigError(
                f"laplacian_heads={self.spec!r} has {len(self.spec)} per-layer entries but the model has "
                f"{n_layers} layers; give exactly one entry per layer")
        if self.kind == "per_layer_k":
            return [self._trailing(k, n_heads, i) for i, k in enumerate(self.spec)]
        flags = []
        for i, idx in enumerate(self.spec):
            for j in idx:
                if j >= n_heads:
                    raise ConfigError(
                        f"laplacian_heads[{i}] contains head index {j}, but layers have {n_heads} "
                        f"heads (allowed 0..{n_heads - 1})")
            chosen = set(idx)
            flags.append(tuple(h in chosen for h in range(n_heads)))
        return flags

    @staticmethod
    def _trailing(k: int, n_heads: int, layer: int | None) -> tuple[bool, ...]:
        where = "" if layer is None else f"[{layer}]"
        if k > n_heads:
            raise ConfigError(
                f"laplacian_heads{where}={k} but layers have only {n_heads} heads (allowed 0..{n_heads})")
        return (False,) * (n_heads - k) + (True,) * k

    def layer_mask(self, layer: int, n_layers: int, n_heads: int) -> torch.Tensor:
        """The boolean head mask of one layer."""
        return self.resolve(n_layers, n_heads)[layer]

    def counts(self, n_layers: int, n_heads: int) -> list[int]:
        """Number of Laplacian heads per layer."""
        return [int(m.sum()) for m in self.resolve(n_layers, n_heads)]

    def is_none(self) -> bool:
        """True when no head can be Laplacian, whatever the model shape."""
        if self.kind == "none":
            return True
        if self.kind == "k":
            return self.spec == 0
        if self.kind == "per_layer_k":
            return all(k == 0 for k in self.spec)
        if self.kind == "per_layer_indices":
            return all(len(i) == 0 for i in self.spec)
        return False

    def to_config(self) -> Any:
        """A JSON/YAML-serialisable value that rebuilds this selection."""
        return self.spec

    def label(self) -> str:
        """A short label for tables and plots (``k=3``, ``all``, ``none``, ``per-layer``, ``learn:standard``)."""
        if self.kind == "learn":
            return self.spec
        if self.kind == "k":
            return f"k={self.spec}"
        if self.kind in ("all", "none"):
            return self.kind
        return "per-layer:" + ",".join(str(k if _is_int(k) else len(k)) for k in self.spec)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LaplacianHeads) and self.spec == other.spec

    def __hash__(self) -> int:
        return hash(repr(self.spec))

    def __repr__(self) -> str:
        return f"LaplacianHeads({self.spec!r})"


def _check_mask_tensor(spec: torch.Tensor, n_heads: int) -> None:
    if spec.dtype != torch.bool:
        raise ConfigError(f"a laplacian_heads tensor must be boolean, got dtype {spec.dtype}")
    if spec.shape != (n_heads,):
        raise ConfigError(
            f"laplacian_heads mask has shape {tuple(spec.shape)}, expected ({n_heads},) (one entry per head)")


def head_flags(spec: Any, n_heads: int) -> tuple[bool, ...]:
    """One layer's selection as a tuple of ``n_heads`` bools (``True`` = Laplacian head).

    Accepts what :func:`head_mask` accepts. Except for a tensor ``spec`` (read back with
    ``tolist()``), no tensor is involved, so the operator can branch on the result without an
    accelerator sync or a ``torch.compile`` graph break.
    """
    if isinstance(spec, torch.Tensor):
        _check_mask_tensor(spec, n_heads)
        return tuple(bool(x) for x in spec.tolist())
    if isinstance(spec, HeadMix):
        raise ConfigError("a HeadMix is learnable mixing, not a fixed selection; pass it to laplacian_attention")
    if isinstance(spec, LaplacianHeads):
        if spec.learnable:
            spec.resolve_flags(1, n_heads)  # raises the learnable-mixing error
        if spec.kind not in ("k", "all", "none"):
            raise ConfigError(
                f"{spec!r} is per-layer; pass the mask of this layer (spec.layer_mask(layer, n_layers, n_heads))")
        return spec.resolve_flags(1, n_heads)[0]
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(x, bool) for x in spec):
        if len(spec) != n_heads:
            raise ConfigError(
                f"laplacian_heads mask {list(spec)!r} has {len(spec)} entries, expected {n_heads} (one per head)")
        return tuple(spec)
    if isinstance(spec, (list, tuple)):
        return LaplacianHeads([list(spec)]).resolve_flags(1, n_heads)[0]
    return LaplacianHeads(spec).resolve_flags(1, n_heads)[0]


def head_mask(spec: Any, n_heads: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean mask of shape ``(n_heads,)`` for ONE layer.

    ``spec`` may be a boolean tensor/list of length ``n_heads``, an int k (trailing k heads),
    ``"all"``/``"none"``, a list of head indices, or a :class:`LaplacianHeads` that is the same for
    every layer (an int, ``"all"`` or ``"none"``).
    """
    if isinstance(spec, torch.Tensor):
        _check_mask_tensor(spec, n_heads)
        return spec.to(device) if device is not None else spec
    m = torch.tensor(head_flags(spec, n_heads), dtype=torch.bool)
    return m.to(device) if device is not None else m


# ---------------------------------------------------------------------- learnable mixing
def init_mix(flags: Sequence[bool], dtype: torch.dtype = torch.float32,
             device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial ``(a, b)`` of one layer: ``(1, -1)`` for a head flagged Laplacian, ``(0, 1)`` otherwise."""
    f = torch.tensor(list(flags), dtype=torch.bool, device=device)
    a = f.to(dtype)
    return a, 1.0 - 2.0 * a


def register_mix(module: torch.nn.Module, flags: Sequence[bool]) -> None:
    """Register ``lap_mix_a`` / ``lap_mix_b`` (shape ``(n_heads,)``) on ``module``, initialised from ``flags``.

    The parameters take the device and floating dtype of the module's first floating parameter
    (float32 when it has none), so a bf16 model stays bf16 in its state_dict.
    """
    ref = next((p for p in module.parameters(recurse=True) if p.is_floating_point()), None)
    dtype = ref.dtype if ref is not None else torch.float32
    device = ref.device if ref is not None else None
    a, b = init_mix(flags, dtype=dtype, device=device)
    module.register_parameter(MIX_PARAM_SUFFIXES[0], torch.nn.Parameter(a))
    module.register_parameter(MIX_PARAM_SUFFIXES[1], torch.nn.Parameter(b))


def remove_mix(module: torch.nn.Module) -> None:
    """Drop ``lap_mix_a`` / ``lap_mix_b`` from ``module`` (when switching back to a fixed selection)."""
    for name in MIX_PARAM_SUFFIXES:
        if name in module._parameters:
            del module._parameters[name]


def is_mix_param(name: str) -> bool:
    """True when ``name`` (a ``named_parameters`` key) is a learnable-mixing parameter."""
    return name.endswith(MIX_PARAM_SUFFIXES)


def laplacianness(a: float, b: float) -> float:
    """Position of ``a I + b P`` along the segment standard ``(0, 1)`` -> Laplacian ``(1, -1)``.

    The orthogonal projection of ``(a, b)`` onto that segment's line: 0 = standard, 1 = Laplacian,
    above 0.5 = nearer the Laplacian operator than the standard one (the rule of
    :func:`suggest_selection`).
    """
    return (a - 2.0 * b + 2.0) / 5.0


@torch.no_grad()
def mixing_table(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The learned ``(a, b)`` of every layer of ``model``, in module order.

    Returns:
        one ``{"layer": module name, "a": [...], "b": [...], "laplacianness": [...]}`` per module
        holding ``lap_mix_a`` / ``lap_mix_b``; an empty list for a model without learnable mixing.
        Plain JSON values (metrics.jsonl logs it at every evaluation).
    """
    rows = []
    for name, mod in model.named_modules():
        a = mod._parameters.get(MIX_PARAM_SUFFIXES[0])
        b = mod._parameters.get(MIX_PARAM_SUFFIXES[1])
        if a is None or b is None:
            continue
        if hasattr(a, "full_tensor"):  # FSDP2 shards them as DTensors (a collective: every rank calls this)
            a, b = a.full_tensor(), b.full_tensor()
        av = [float(x) for x in a.detach().float().cpu().tolist()]
        bv = [float(x) for x in b.detach().float().cpu().tolist()]
        rows.append({"layer": name, "a": av, "b": bv,
                     "laplacianness": [round(laplacianness(x, y), 6) for x, y in zip(av, bv)]})
    return rows


def suggest_selection(tables: Sequence[Sequence[dict[str, Any]]]) -> list[list[int]]:
    """A fixed per-layer selection from one or more :func:`mixing_table` results (e.g. seeds).

    A head is suggested Laplacian when its mean Laplacian-ness over the tables is above 0.5,
    i.e. its learned ``(a, b)`` lies nearer ``(1, -1)`` (Laplacian) than ``(0, 1)`` (standard).

    Returns:
        per-layer head-index lists, a valid :class:`LaplacianHeads` spec.

    Raises:
        ConfigError: no table, or tables of different shapes.
    """
    tables = [t for t in tables if t]
    if not tables:
        raise ConfigError("no learned mixing to suggest a selection from (the runs have no lap_mix values)")
    shape = [len(r["a"]) for r in tables[0]]
    for t in tables[1:]:
        if [len(r["a"]) for r in t] != shape:
            raise ConfigError("the learned mixing tables have different shapes (layers x heads); "
                              "suggest a selection per model shape")
    out = []
    for i, n in enumerate(shape):
        mean = [sum(laplacianness(t[i]["a"][h], t[i]["b"][h]) for t in tables) / len(tables) for h in range(n)]
        out.append([h for h, x in enumerate(mean) if math.isfinite(x) and x > 0.5])
    return out


def learnable_spec(spec: Any) -> "LaplacianHeads | None":
    """The :class:`LaplacianHeads` of ``spec`` when it asks for learnable mixing, else None (no validation of fixed specs)."""
    if isinstance(spec, LaplacianHeads):
        return spec if spec.learnable else None
    if isinstance(spec, str) and spec.strip().lower().split(":")[0].strip() == "learn":
        return LaplacianHeads(spec)
    return None
