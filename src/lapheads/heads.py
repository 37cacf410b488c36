"""Which heads of which layer are Laplacian.

:class:`LaplacianHeads` validates every setting (``3``: the trailing 3 heads of every layer; the
others are listed in docs/heads.md) and resolves it to one :class:`LayerHeads` per layer; an invalid
value raises :class:`lapheads.errors.ConfigError`. Learnable mixing ``a_h I + b_h P`` lives in
parameters ``lap_mix_a`` / ``lap_mix_b`` (a :class:`HeadMix` for the operator); :func:`mixing_table`
reads them back, :func:`suggest_selection` turns them into a fixed selection.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any, NamedTuple, Optional, Sequence, Union, cast

import torch

from . import epilogue
from .errors import ConfigError

HeadSpec = Union[int, str, Sequence[int], Sequence[Sequence[int]], "LaplacianHeads", None]

_ALLOWED = (
    "an int k >= 0 (trailing k heads of every layer), 'all', 'none', a per-layer list of ints, "
    "a per-layer list of head-index lists, 'learn' / 'learn:standard' / 'learn:laplacian' / 'learn:<k>' "
    "(learnable mixing), or an ablation of the trailing K heads: 'identity:K', 'negated:K', 'mix(a,b):K'"
)

#: Parameter-name suffixes of the learnable mixing (a, b); optimizers match on them.
MIX_PARAM_SUFFIXES: tuple[str, str] = ("lap_mix_a", "lap_mix_b")


class HeadMix(NamedTuple):
    """Per-head mixing ``a_h I + b_h P`` (``a``, ``b`` of shape ``(H,)``; standard ``(0, 1)``, Laplacian
    ``(1, -1)``): pass it as ``laplacian_heads=`` of :func:`lapheads.laplacian_attention` (gradients flow)."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def any(self) -> bool:
        """Learnable mixing always runs the head operator (it is never plain SDPA)."""
        return True

    @property
    def identity(self) -> bool:
        """The identity term is always there (``a`` may become nonzero): ``v_self`` is needed."""
        return True

    def coefficients(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a, b)`` in ``dtype`` (no graph node when the dtype agrees)."""
        return self.a.to(dtype), self.b.to(dtype)

    def apply(self, pv: torch.Tensor, v_self: torch.Tensor, tape: Optional[epilogue.Tape] = None) -> torch.Tensor:
        """``a_h v_self + b_h pv`` per head (see :func:`lapheads.epilogue.combine`)."""
        return epilogue.combine(pv, v_self, self.coefficients(v_self.dtype), tape)

    def operator(self, p: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
        """The explicit operator ``a_h I + b_h P`` (heads on dim -3 of ``p``)."""
        return epilogue.explicit(self.coefficients(p.dtype), p, eye)


def _parse_learn(spec: str, name: str = "laplacian_heads") -> Union[str, int]:
    """``"learn"``, ``"learn:standard"``, ``"learn:laplacian"``, ``"learn:<k>"`` -> the initialisation."""
    _, _, init = spec.partition(":")
    init = init.strip() or "standard"
    if init in ("standard", "laplacian"):
        return init
    if _digits(init):
        return int(init)
    raise ConfigError(
        f"{name}={spec!r}: the learnable initialisation must be 'standard', 'laplacian' or "
        f"an int k >= 0 (trailing k heads start Laplacian), e.g. 'learn:laplacian' or 'learn:2'"
    )


_ABLATION = re.compile(r"^(identity|negated|mix\(.*\))\s*:")
_NUMBER = r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*"
_MIX = re.compile(rf"^mix\({_NUMBER},{_NUMBER}\)$")
#: ``(a, b)`` of the named ablation heads.
ABLATIONS: dict[str, tuple[float, float]] = {"identity": (1.0, 0.0), "negated": (0.0, -1.0)}


def _parse_ablation(spec: str, name: str) -> tuple[tuple[float, float], int]:
    """``"identity:K"``, ``"negated:K"``, ``"mix(a,b):K"`` -> ``((a, b), K)``."""
    head, _, k = spec.rpartition(":")
    head, k = head.strip(), k.strip()
    if not _digits(k):
        raise ConfigError(f"{name}={spec!r}: the head count after ':' must be an int K >= 0, e.g. 'identity:2'")
    if head in ABLATIONS:
        return ABLATIONS[head], int(k)
    m = _MIX.match(head)
    if m is None:
        raise ConfigError(
            f"{name}={spec!r}: a fixed mixing is 'mix(a,b):K' with two numbers, e.g. 'mix(0.5,-1):2' "
            "(the trailing K heads apply a I + b P)"
        )
    a, b = float(m.group(1)), float(m.group(2))
    if not (math.isfinite(a) and math.isfinite(b)):
        raise ConfigError(f"{name}={spec!r}: a and b must be finite numbers")
    return (a, b), int(k)


def _is_learn(spec: Any) -> bool:
    return isinstance(spec, str) and spec.strip().lower().split(":")[0].strip() == "learn"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _digits(text: str) -> bool:
    """ASCII digits only (``str.isdigit`` also accepts '²' or '٣', which ``int`` refuses or misreads)."""
    return text.isascii() and text.isdigit()


def is_count(spec: Any) -> bool:
    """True for a head count k as a spec gives it: an int (not a bool) or its text in ASCII digits."""
    return _is_int(spec) or (isinstance(spec, str) and _digits(spec.strip()))


@dataclasses.dataclass(frozen=True)
class LayerHeads:
    """The fixed head operator of ONE attention layer: ``flags[h]`` is True when head h is Laplacian.

    A flagged head applies ``coef`` (``a I + b P``), the others are standard ``(0, 1)``. :meth:`apply`
    finishes the layer after SDPA, :meth:`operator` gives the explicit matrix. Frozen and hashable;
    build one with :meth:`LaplacianHeads.resolve` or :meth:`of`.

    Args:
        flags: one bool per head (a list is turned into a tuple); at least one head.
        coef: ``(a, b)`` of the flagged heads, default ``(1, -1)``.
    """

    flags: tuple[bool, ...]
    coef: tuple[float, float] = epilogue.LAPLACIAN
    # Device masks already built, by device; not part of equality, hash or repr.
    _masks: dict[Any, torch.Tensor] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        flags = self.flags
        if not isinstance(flags, (tuple, list)) or not flags or any(type(f) is not bool for f in flags):
            raise ConfigError(
                f"LayerHeads(flags={flags!r}): flags must be a non-empty tuple of bools, one per "
                "head (True = Laplacian); use LayerHeads.of(spec, n_heads) for other forms"
            )
        object.__setattr__(self, "flags", tuple(flags))
        a, b = self.coef
        object.__setattr__(self, "coef", (float(a), float(b)))
        std = epilogue.STANDARD
        object.__setattr__(self, "_runs", epilogue.Runs.of(tuple(self.coef if f else std for f in self.flags)))

    def __repr__(self) -> str:
        extra = "" if self.coef == epilogue.LAPLACIAN else f", coef={self.coef!r}"
        return f"LayerHeads(flags={self.flags!r}{extra})"

    @property
    def runs(self) -> epilogue.Runs:
        """The per-head coefficients ``(a, b)`` as runs of consecutive heads (what the epilogue loops over)."""
        return self._runs  # type: ignore[attr-defined,no-any-return]

    @property
    def identity(self) -> bool:
        """Some head has an identity term (``a != 0``), so every query needs its own position among the keys."""
        return self.any and self.coef[0] != 0

    def apply(self, pv: torch.Tensor, v_self: torch.Tensor, tape: Optional[epilogue.Tape] = None) -> torch.Tensor:
        """This layer's heads after SDPA (``pv`` ``(..., H, Tq, D)``, ``v_self`` ``(..., H_kv, Tq, D)``):
        ``v_self - pv`` on the Laplacian heads, ``pv`` on the others (:func:`lapheads.epilogue.combine`)."""
        if not self.any:
            return pv
        return epilogue.combine(pv, v_self, self.runs, tape)

    def operator(self, p: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
        """The explicit operator per head: ``P`` on standard heads, ``I - P`` on Laplacian ones."""
        return epilogue.explicit(self.runs, p, eye)

    @classmethod
    def of(cls, spec: Any, n_heads: int) -> "LayerHeads":
        """One layer's selection, validated against ``n_heads``, from a :class:`LayerHeads`, an int k
        (trailing k heads), ``"all"``/``"none"``, head indices, a boolean list/tensor of length
        ``n_heads``, or a :class:`LaplacianHeads` that is the same for every layer."""
        if isinstance(spec, LayerHeads):
            if spec.n_heads != n_heads:
                raise ConfigError(f"{spec!r} has {spec.n_heads} heads, expected {n_heads} (one flag per head)")
            return spec
        if isinstance(spec, torch.Tensor):
            _check_mask_tensor(spec, n_heads)
            return cls(tuple(bool(x) for x in spec.tolist()))
        if isinstance(spec, HeadMix):
            raise ConfigError("a HeadMix is learnable mixing, not a fixed selection; pass it to laplacian_attention")
        if isinstance(spec, LaplacianHeads):
            if spec.kind in ("per_layer_k", "per_layer_indices"):
                raise ConfigError(
                    f"{spec!r} is per-layer; pass the selection of this layer (spec.resolve(n_layers, n_heads)[layer])"
                )
            return spec.resolve(1, n_heads)[0]  # a learnable spec raises the learnable-mixing error
        if isinstance(spec, (list, tuple)) and spec and all(isinstance(x, bool) for x in spec):
            if len(spec) != n_heads:
                raise ConfigError(
                    f"laplacian_heads mask {list(spec)!r} has {len(spec)} entries, expected {n_heads} (one per head)"
                )
            return cls(tuple(spec))
        if isinstance(spec, (list, tuple)):
            return LaplacianHeads([list(spec)]).resolve(1, n_heads)[0]
        return LaplacianHeads(spec).resolve(1, n_heads)[0]

    @property
    def n_heads(self) -> int:
        return len(self.flags)

    @property
    def any(self) -> bool:
        """At least one Laplacian head (False: the layer is standard attention)."""
        return any(self.flags)

    @property
    def all(self) -> bool:
        """Every head is Laplacian."""
        return all(self.flags)

    @property
    def count(self) -> int:
        """Number of Laplacian heads."""
        return sum(self.flags)

    @property
    def indices(self) -> tuple[int, ...]:
        """Indices of the Laplacian heads, ascending."""
        return tuple(h for h, f in enumerate(self.flags) if f)

    def mask(self, device: Any = None) -> torch.Tensor:
        """The selection as a boolean ``(n_heads,)`` tensor on ``device`` (CPU by default), cached and shared:
        read it, do not write into it. Built outside inference mode, so it also serves a later training step."""
        dev = torch.device("cpu") if device is None else torch.device(device)
        m = self._masks.get(dev)
        if m is None:
            with torch.inference_mode(False):
                m = torch.tensor(self.flags, dtype=torch.bool, device=dev)
            self._masks[dev] = m
        return m


#: The one default of a recipe's ``laplacian_heads`` field: no Laplacian head (the baseline).
DEFAULT_LAPLACIAN_HEADS: Any = 0


class LaplacianHeads:
    """A validated description of the Laplacian heads of a model.

    Args:
        spec: ``int`` k, ``"all"``, ``"none"``, ``None`` (same as ``"none"``), a per-layer list of
            ints, a per-layer list of index lists, ``"learn..."``, or another :class:`LaplacianHeads`.
        name: how error messages name the value (``model.laplacian_heads`` for a config key).
    """

    spec: Any  # the normalised setting: an int k, "all" / "none", a per-layer list, "learn:<init>" or an ablation
    kind: str  # "k", "all", "none", "per_layer_k", "per_layer_indices", "learn" or "ablation"

    def __init__(self, spec: Any = "none", *, name: str = "laplacian_heads"):  # spec: a HeadSpec
        if isinstance(spec, LaplacianHeads):
            spec = spec.spec
        if spec is None:
            spec = "none"
        self.learn_init: Union[str, int, None] = None
        #: an ablation head's ``(a, b)`` and how many trailing heads get it (``kind == "ablation"``).
        self.ablation: Optional[tuple[tuple[float, float], int]] = None
        if _is_learn(spec):
            self.learn_init = _parse_learn(spec.strip().lower(), name)
            self.kind = "learn"
            self.spec = f"learn:{self.learn_init}"
            return
        if isinstance(spec, str) and _ABLATION.match(spec.strip().lower()):
            coef, k = _parse_ablation(spec.strip().lower(), name)
            if coef == (1.0, -1.0) or coef == (0.0, 1.0):  # Laplacian or standard: one spelling, k
                spec = k if coef == (1.0, -1.0) else 0
            else:
                self.ablation = (coef, k)
                self.kind = "ablation"
                self.spec = next(
                    (f"{w}:{k}" for w, ab in ABLATIONS.items() if ab == coef), f"mix({coef[0]:g},{coef[1]:g}):{k}"
                )
                return
        if isinstance(spec, str):
            s = spec.strip().lower()
            if s not in ("all", "none") and not _digits(s.removeprefix("-")):
                raise ConfigError(f"{name}={spec!r} is not understood; allowed: {_ALLOWED}")
            spec = s if s in ("all", "none") else int(s)
        if _is_int(spec):
            if spec < 0:
                raise ConfigError(f"{name}={spec} is negative; allowed: {_ALLOWED}")
            self.kind = "k"
        elif isinstance(spec, str):
            self.kind = spec
        elif isinstance(spec, (list, tuple)):
            items = list(spec)
            if all(_is_int(x) for x in items):
                for i, x in enumerate(items):
                    if x < 0:
                        raise ConfigError(f"{name}[{i}]={x} is negative; per-layer counts must be >= 0")
                self.kind = "per_layer_k"
                spec = items
            elif all(isinstance(x, (list, tuple)) for x in items):
                for i, idx in enumerate(items):
                    for j in idx:
                        if not _is_int(j):
                            raise ConfigError(f"{name}[{i}] contains {j!r}; head indices must be ints")
                        if j < 0:
                            raise ConfigError(f"{name}[{i}] contains negative head index {j}")
                    if len(set(idx)) != len(idx):
                        raise ConfigError(f"{name}[{i}]={list(idx)} has duplicate head indices")
                self.kind = "per_layer_indices"
                spec = [list(idx) for idx in items]
            else:
                raise ConfigError(f"{name}={spec!r} mixes types; allowed: {_ALLOWED}")
        else:
            raise ConfigError(f"{name}={spec!r} has type {type(spec).__name__}; allowed: {_ALLOWED}")
        self.spec = spec

    @classmethod
    def learn(cls, init: Union[str, int] = "standard") -> "LaplacianHeads":
        """Learnable mixing ``a_h I + b_h P``; ``init``: "standard", "laplacian" or k (trailing k start Laplacian)."""
        if _is_int(init) and int(init) < 0:
            raise ConfigError(f"LaplacianHeads.learn(init={init}): k must be >= 0")
        if not (_is_int(init) or isinstance(init, str)):
            raise ConfigError(f"LaplacianHeads.learn(init={init!r}): init must be 'standard', 'laplacian' or an int k")
        return cls(f"learn:{init}")

    @property
    def learnable(self) -> bool:
        """True for learnable mixing (``"learn..."``): the modules hold parameters ``lap_mix_a/b``."""
        return self.kind == "learn"

    def init_selection(self, n_layers: int, n_heads: int) -> list[LayerHeads]:
        """For a learnable spec, the heads that START Laplacian (``a=1, b=-1``); for a fixed spec, :meth:`resolve`."""
        if not self.learnable:
            return self.resolve(n_layers, n_heads)
        init = self.learn_init
        spec = "all" if init == "laplacian" else ("none" if init == "standard" else init)
        return LaplacianHeads(spec).resolve(n_layers, n_heads)

    def resolve(self, n_layers: int, n_heads: int) -> list[LayerHeads]:
        """One :class:`LayerHeads` per layer, validated against the model shape.

        Raises:
            ConfigError: the spec does not fit the shape, or it is learnable (see :meth:`init_selection`).
        """
        if n_layers < 1 or n_heads < 1:
            raise ConfigError(f"model shape n_layers={n_layers}, n_heads={n_heads} must be positive")
        if self.kind == "learn":
            raise ConfigError(
                f"laplacian_heads={self.spec!r} is learnable mixing, not a fixed set of heads; it needs a module "
                "that holds the parameters (lapheads.nn.MultiheadAttention, lapheads.timm.convert, "
                "lapheads.transformers.enable) or a HeadMix(a, b) for the operator"
            )
        if self.kind == "ablation":
            assert self.ablation is not None
            coef, k = self.ablation
            return [LayerHeads(self._trailing(k, n_heads, None).flags, coef)] * n_layers
        if self.kind in ("k", "all", "none"):
            k = {"all": n_heads, "none": 0}.get(self.kind, self.spec)
            return [self._trailing(k, n_heads, None)] * n_layers
        if len(self.spec) != n_layers:
            raise ConfigError(
                f"laplacian_heads={self.spec!r} has {len(self.spec)} per-layer entries but the model has "
                f"{n_layers} layers; give exactly one entry per layer"
            )
        if self.kind == "per_layer_k":
            return [self._trailing(k, n_heads, i) for i, k in enumerate(self.spec)]
        for i, idx in enumerate(self.spec):
            for j in idx:
                if j >= n_heads:
                    raise ConfigError(
                        f"laplacian_heads[{i}] contains head index {j}, but layers have {n_heads} "
                        f"heads (allowed 0..{n_heads - 1})"
                    )
        return [LayerHeads(tuple(h in idx for h in range(n_heads))) for idx in self.spec]

    @staticmethod
    def _trailing(k: int, n_heads: int, layer: int | None) -> LayerHeads:
        where = "" if layer is None else f"[{layer}]"
        if k > n_heads:
            raise ConfigError(f"laplacian_heads{where}={k} but layers have only {n_heads} heads (allowed 0..{n_heads})")
        return LayerHeads((False,) * (n_heads - k) + (True,) * k)

    def layer_mask(self, layer: int, n_layers: int, n_heads: int) -> torch.Tensor:
        """The boolean head mask of one layer (a new CPU tensor). Deprecated: use ``resolve(...)[layer].mask()``."""
        warnings.warn(
            "LaplacianHeads.layer_mask is deprecated and will be removed in the next release; use "
            "spec.resolve(n_layers, n_heads)[layer].mask()",
            DeprecationWarning,
            stacklevel=2,
        )
        return torch.tensor(self.resolve(n_layers, n_heads)[layer].flags, dtype=torch.bool)

    def counts(self, n_layers: int, n_heads: int) -> list[int]:
        """Number of Laplacian heads per layer."""
        return [sel.count for sel in self.resolve(n_layers, n_heads)]

    def is_none(self) -> bool:
        """True when no head can be Laplacian, whatever the model shape."""
        if self.kind == "ablation":
            return self.ablation is not None and self.ablation[1] == 0
        if self.kind in ("per_layer_k", "per_layer_indices"):
            return not any(self.spec)  # every count 0, every index list empty
        return self.kind == "none" or (self.kind == "k" and self.spec == 0)

    def to_config(self) -> Any:
        """A JSON/YAML-serialisable value that rebuilds this selection."""
        return self.spec

    def label(self) -> str:
        """A short label for tables and plots (``k=3``, ``all``, ``none``, ``per-layer``, ``learn:standard``,
        ``identity:3``)."""
        if self.kind in ("learn", "ablation"):
            return str(self.spec)
        if self.kind == "k":
            return f"k={self.spec}"
        if self.kind in ("all", "none"):
            return self.kind
        return "per-layer:" + ",".join(str(k if _is_int(k) else len(k)) for k in self.spec)

    def _order(self) -> tuple[Any, ...]:
        # (group, rank, detail, text): every key has this shape, and two keys only reach `detail`
        # when group and rank are equal, where the details have the same structure, so any two
        # keys compare without a TypeError.
        if self.kind in ("none", "k", "all"):
            return (1, 0, (), "") if self.kind == "all" else (0, self.spec if self.kind == "k" else 0, (), "")
        if self.kind == "per_layer_k":
            return (2, 0, tuple(self.spec), "")
        if self.kind == "per_layer_indices":
            return (2, 1, tuple(tuple(i) for i in self.spec), "")
        if self.kind == "ablation":
            assert self.ablation is not None
            (a, b), k = self.ablation
            return (3, 3, (a, b, k), "")
        if _is_int(self.learn_init):
            return (3, 1, (self.learn_init,), "")
        return (3, 0 if self.learn_init == "standard" else 2, (), "")

    @classmethod
    def sort_key(cls, value: Any) -> tuple[Any, ...]:
        """A sort key for settings: none = k=0 < k=1 < ... < all < per-layer lists < learnable mixing < ablations.

        Args:
            value: a :class:`LaplacianHeads`, anything it accepts, or a :meth:`label` (``"k=3"``,
                ``"per-layer:0,2"``, ``"learn:standard"``); a value that is no setting sorts last, by its text.
        """
        spec = value
        if isinstance(value, str):
            text = value.strip().lower()
            if text.startswith("k="):
                spec = text[2:]
            elif text.startswith("per-layer:"):
                parts = text[len("per-layer:") :].split(",")
                spec = [int(p) for p in parts] if all(_digits(p.strip()) for p in parts) else value
        try:
            return cls(spec)._order()
        except ConfigError:
            return (4, 0, (), str(value))

    @classmethod
    def parse_config_value(cls, value: Any, key: str = "laplacian_heads") -> Any:
        """Check a config value of ``key`` when the config is parsed; return it as written (a :class:`LaplacianHeads`:
        its :meth:`to_config`).

        Raises:
            ConfigError: one line naming ``key``, the value and what is allowed.
        """
        heads = cls(value, name=key)
        return heads.to_config() if isinstance(value, LaplacianHeads) else value

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
            f"laplacian_heads mask has shape {tuple(spec.shape)}, expected ({n_heads},) (one entry per head)"
        )


def head_mask(spec: Any, n_heads: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean ``(n_heads,)`` mask for ONE layer. Deprecated: use ``LayerHeads.of(spec, n_heads).mask(device)``."""
    warnings.warn(
        "lapheads.head_mask is deprecated and will be removed in the next release; use "
        "lapheads.LayerHeads.of(spec, n_heads).mask(device)",
        DeprecationWarning,
        stacklevel=2,
    )
    if isinstance(spec, torch.Tensor):
        _check_mask_tensor(spec, n_heads)
        return spec.to(device) if device is not None else spec
    return torch.tensor(LayerHeads.of(spec, n_heads).flags, dtype=torch.bool, device=device)


#: What one attention layer applies after SDPA: fixed (:class:`LayerHeads`) or learnable (:class:`HeadMix`).
HeadOperator = Union["LayerHeads", HeadMix]


def layer_operator(module: torch.nn.Module) -> HeadOperator:
    """The head operator of a Laplacian attention module: its learnable mixing when it holds
    ``lap_mix_a`` / ``lap_mix_b``, else its fixed selection ``laplacian_selection``."""
    a, b = (module._parameters.get(name) for name in MIX_PARAM_SUFFIXES)
    if a is not None and b is not None:
        return HeadMix(a, b)
    return cast(LayerHeads, cast(Any, module).laplacian_selection)


def set_layer_heads(module: torch.nn.Module, spec: Any, n_heads: int) -> HeadOperator:
    """Give one attention module the heads of ``spec`` (``"learn..."`` included) and return its operator: sets
    ``laplacian_selection`` and ``laplacian_learnable``, and (re)creates or removes ``lap_mix_a`` / ``lap_mix_b``."""
    learn = learnable_spec(spec)
    if learn is not None:
        selection = learn.init_selection(1, n_heads)[0]
        register_mix(module, selection)
    else:
        selection = LayerHeads.of(spec, n_heads)
        remove_mix(module)
    # Plain attributes (not parameters or buffers): the state_dict keys stay the host library's.
    target = cast(Any, module)
    target.laplacian_selection = selection
    target.laplacian_learnable = learn is not None
    return layer_operator(module)


def init_mix(
    flags: Union[LayerHeads, Sequence[bool]], dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial ``(a, b)`` of one layer: ``(1, -1)`` for a head flagged Laplacian, ``(0, 1)`` otherwise."""
    if isinstance(flags, LayerHeads):
        flags = flags.flags
    f = torch.tensor(list(flags), dtype=torch.bool, device=device)
    a = f.to(dtype)
    return a, 1.0 - 2.0 * a


def register_mix(module: torch.nn.Module, flags: Union[LayerHeads, Sequence[bool]]) -> None:
    """Register ``lap_mix_a`` / ``lap_mix_b`` (shape ``(n_heads,)``) on ``module``, initialised from ``flags``,
    in the device and dtype of its first floating parameter (float32 when it has none)."""
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


def param_groups(
    model: torch.nn.Module, lr: float, weight_decay: float, mix_lr_scale: float = 1.0
) -> list[dict[str, Any]]:
    """Parameter groups that keep the learnable mixing out of weight decay:
    ``torch.optim.AdamW(param_groups(model, lr=1e-3, weight_decay=0.05))``.

    Args:
        model: any module; its trainable parameters are split by name (:func:`is_mix_param`).
        lr: the learning rate of the model's other parameters.
        weight_decay: their weight decay (the mixing parameters get none).
        mix_lr_scale: the mixing parameters' learning rate is ``lr * mix_lr_scale``.

    Returns:
        the other parameters' group, then the mixing parameters'; a group with no parameter is left out.

    Raises:
        ConfigError: ``mix_lr_scale`` is not a finite number > 0.
    """
    if isinstance(mix_lr_scale, bool) or not isinstance(mix_lr_scale, (int, float)) or not 0 < mix_lr_scale < math.inf:
        raise ConfigError(f"mix_lr_scale={mix_lr_scale!r} must be a finite number > 0")
    mix: list[torch.nn.Parameter] = []
    other: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (mix if is_mix_param(name) else other).append(p)
    groups = [
        {"params": other, "lr": lr, "weight_decay": weight_decay},
        {"params": mix, "lr": lr * mix_lr_scale, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def mix_angle(a: float, b: float) -> float:
    """The angle ``atan(a / b)`` of ``a I + b P`` in degrees, folded into ``(-90, 90]`` (the output projection
    absorbs any common factor of ``(a, b)``): 0 = standard, -45 = Laplacian, +-90 = identity; ``(0, 0)`` is NaN."""
    if a == 0 and b == 0:
        return math.nan
    theta = math.degrees(math.atan2(a, b))
    if theta > 90.0:
        theta -= 180.0
    elif theta <= -90.0:
        theta += 180.0
    return theta


def laplacianness(a: float, b: float) -> float:
    """Scale-free position of ``a I + b P``: ``-mix_angle / 45``; 0 = standard, 1 = Laplacian (``(2, -2)`` and
    ``(-1, 1)`` alike), negative = ``P`` plus some of the head's own value, +-2 = the identity alone."""
    return -mix_angle(a, b) / 45.0


def nearer_laplacian(lap: float) -> bool:
    """Whether Laplacian-ness ``lap`` is nearer the Laplacian operator than the standard one, by angle between
    lines: ``lap > 0.5``, or ``lap < -1.5`` (mostly the identity)."""
    return math.isfinite(lap) and (lap > 0.5 or lap < -1.5)


@torch.no_grad()
def mixing_table(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The learned ``(a, b)`` of every layer of ``model``, in module order.

    Returns:
        one ``{"layer": module name, "a": [...], "b": [...], "laplacianness": [...]}`` (plain JSON)
        per module holding ``lap_mix_a`` / ``lap_mix_b``.
    """
    rows = []
    for name, mod in model.named_modules():
        a, b = (mod._parameters.get(n) for n in MIX_PARAM_SUFFIXES)
        if a is None or b is None:
            continue
        if hasattr(a, "full_tensor"):  # FSDP2 shards them as DTensors (a collective: every rank calls this)
            a, b = a.full_tensor(), b.full_tensor()
        av, bv = a.detach().float().cpu().tolist(), b.detach().float().cpu().tolist()
        rows.append(
            {"layer": name, "a": av, "b": bv, "laplacianness": [round(laplacianness(x, y), 6) for x, y in zip(av, bv)]}
        )
    return rows


def suggest_selection(tables: Sequence[Sequence[dict[str, Any]]]) -> list[list[int]]:
    """A fixed per-layer selection from one or more :func:`mixing_table` results (e.g. seeds).

    A head is suggested Laplacian when its mean :func:`laplacianness` is nearer the Laplacian operator.

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
            raise ConfigError(
                "the learned mixing tables have different shapes (layers x heads); suggest a selection per model shape"
            )
    out = []
    for i, n in enumerate(shape):
        mean = [sum(laplacianness(t[i]["a"][h], t[i]["b"][h]) for t in tables) / len(tables) for h in range(n)]
        out.append([h for h, x in enumerate(mean) if nearer_laplacian(x)])
    return out


def learnable_spec(spec: Any) -> "LaplacianHeads | None":
    """The :class:`LaplacianHeads` of ``spec`` when it asks for learnable mixing, else None (no validation of fixed specs)."""
    if isinstance(spec, LaplacianHeads):
        return spec if spec.learnable else None
    return LaplacianHeads(spec) if _is_learn(spec) else None
