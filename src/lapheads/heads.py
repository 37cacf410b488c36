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
=====================================  ============================================

``resolve(n_layers, n_heads)`` returns one boolean mask of shape ``(n_heads,)`` per layer. Every
invalid value raises :class:`lapheads.errors.ConfigError` (a ``ValueError``) that says what was
given and what is allowed.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import torch

from .errors import ConfigError

HeadSpec = Union[int, str, Sequence[int], Sequence[Sequence[int]], "LaplacianHeads", None]

_ALLOWED = (
    "an int k >= 0 (trailing k heads of every layer), 'all', 'none', a per-layer list of ints, "
    "or a per-layer list of head-index lists"
)


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
        """A short label for tables and plots (``k=3``, ``all``, ``none``, ``per-layer``)."""
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
    if isinstance(spec, LaplacianHeads):
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
