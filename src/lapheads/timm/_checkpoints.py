"""``create_model``: build or reload a timm model with its Laplacian heads, and the registered ``_lap<k>`` variants."""

from __future__ import annotations

import difflib
import inspect
import re
import sys
from typing import Any, Optional, cast

import timm
import torch
from torch import nn

from ..errors import ConfigError
from ..heads import HeadSpec, LaplacianHeads, is_mix_param
from ._convert import convert, laplacian_attention_layers
from ._layers import (
    COEF,
    MARKER,
    MIX_FIXED,
    MIX_LAPLACIAN,
    MIX_LEARNABLE,
    MIX_STANDARD,
    LaplacianLayer,
    _heads_of,
    decode_coef,
)

#: timm base models that get registered ``_lap<k>`` variants, with their number of heads.
VARIANT_BASES: dict[str, int] = {
    "deit3_small_patch16_224": 6,
    "deit3_base_patch16_224": 12,
    "deit3_large_patch16_224": 16,
}
_LAP_NAME = re.compile(r"^(?P<base>.+)_lap(?P<k>\d+)$")
_PACKAGE = __name__.rpartition(".")[0]  # lapheads.timm, where the entrypoints live
#: state-dict keys a stock timm model does not have (the marker, fixed and learnable mixing).
_LAPLACIAN_KEY = re.compile(rf"(?:^|\.)(?:{MARKER}|{COEF}|lap_mix_a|lap_mix_b)$")
#: every timm name registered by ``import lapheads.timm`` (filled by :func:`register_variants`).
REGISTERED_MODELS: list[str] = []


def _split_lap_name(name: str) -> tuple[str, Optional[int]]:
    """``deit3_base_patch16_224_lap12`` -> (``deit3_base_patch16_224``, 12); other names -> (name, None)."""
    m = _LAP_NAME.match(name)
    if m and m.group("base") in VARIANT_BASES:
        return m.group("base"), int(m.group("k"))
    return name, None


def create_model(name: str, laplacian_heads: HeadSpec = None, **timm_kwargs: Any) -> nn.Module:
    """Create a timm model with Laplacian heads, or reload a saved one.

    Args:
        name: any timm model name with attention :func:`convert` converts (``vit_small_patch16_224``,
            ``deit3_base_patch16_224.fb_in1k``, ``eva02_small_patch14_224``, ...), a registered variant
            ``<base>_lap<k>`` (k comes from the name), or a model saved with ``timm.models.save_for_hf``
            / ``push_to_hf_hub``: ``local-dir:PATH`` or ``hf-hub:REPO`` (its ``config.json`` gives the
            architecture, and the weights load by default).
        laplacian_heads: the selection (see :func:`convert`). ``None``: the heads of a Laplacian
            checkpoint being loaded, else k from a ``_lap<k>`` name, else none. A selection given
            with a Laplacian checkpoint replaces its heads on purpose (retrofitting).
        **timm_kwargs: passed to ``timm.create_model`` (``pretrained``, ``pretrained_cfg_overlay``,
            ``checkpoint_path``, ``num_classes``, ``img_size``, ``depth``, ...).

    Returns:
        the converted model; ``model.laplacian_heads`` holds the selection.

    Raises:
        ConfigError: an unknown name, a selection that does not fit (or differs from a ``_lap<k>``
            name's), a ``_lap<k>`` name with ``pretrained=True`` and no checkpoint to load.
        RuntimeError: timm's strict load: weights of another architecture.
    """
    saved = _saved_model_config(name, timm_kwargs.get("cache_dir"))
    if saved is not None:
        cfg, name, model_args = saved
        if timm_kwargs.get("pretrained_cfg") is not None:
            raise ConfigError(
                "pretrained_cfg cannot be given with a local-dir: or hf-hub: name: its config.json is the "
                "pretrained_cfg (use pretrained_cfg_overlay to change entries)"
            )
        timm_kwargs["pretrained_cfg"] = cfg
        timm_kwargs.setdefault("pretrained", True)
        for key, value in model_args.items():
            timm_kwargs.setdefault(key, value)
        if model_args and _TIMM_TAKES_MODEL_ARGS:
            timm_kwargs.setdefault("pretrained_model_args", dict(model_args))
    replaces = laplacian_heads is not None  # the caller's heads replace a checkpoint's on purpose
    base, k = _split_lap_name(name)
    if k is not None:
        if laplacian_heads is not None and LaplacianHeads(laplacian_heads) != LaplacianHeads(k):
            raise ConfigError(
                f"model name {name!r} means laplacian_heads={k}, but laplacian_heads={laplacian_heads!r} was "
                f"also given; use the base name {base!r} with laplacian_heads, or drop laplacian_heads"
            )
        laplacian_heads = k
    LaplacianHeads(laplacian_heads)  # validate the type before building anything
    if not timm.is_model(base):
        close = difflib.get_close_matches(name, timm.list_models() + REGISTERED_MODELS, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see timm.list_models() for names"
        raise ConfigError(f"unknown timm model name {name!r}{hint}")
    return _create(name, base, laplacian_heads, timm_kwargs, replaces=replaces)


_TIMM_TAKES_MODEL_ARGS = "pretrained_model_args" in inspect.signature(timm.models.build_model_with_cfg).parameters
_WEIGHT_SOURCE_KEYS = ("state_dict", "source", "file", "url", "hf_hub_id", "hf_hub_filename")


def _saved_model_config(name: str, cache_dir: Any = None) -> Optional[tuple[dict[str, Any], str, dict[str, Any]]]:
    """``local-dir:PATH`` / ``hf-hub:REPO`` -> (pretrained_cfg, architecture, model_args) read by timm; else None."""
    if not name.startswith(("local-dir:", "hf-hub:", "hf_hub:")):
        return None
    source, ident = timm.models.parse_model_name(name)
    if source == "local-dir":
        from timm.models._hub import load_model_config_from_path  # not re-exported by timm.models

        try:
            return load_model_config_from_path(ident)
        except FileNotFoundError as e:
            raise ConfigError(f"{name!r}: {e}; save a model there with timm.models.save_for_hf(model, PATH)") from None
    if source == "hf-hub":
        return timm.models.load_model_config_from_hf(ident, **_cache(cache_dir))
    return None


def _cache(cache_dir: Any) -> dict[str, Any]:
    """timm's ``cache_dir`` keyword, passed on only when given."""
    return {} if cache_dir is None else {"cache_dir": cache_dir}


def _named_weights(cfg: dict[str, Any], cache_dir: Any = None) -> Optional[dict[str, torch.Tensor]]:
    """The state dict ``cfg`` names, read by timm's loaders; None for timm's registry weights (never Laplacian)."""
    if cfg.get("state_dict") is not None:
        return dict(cfg["state_dict"])
    if cfg.get("source") == "local-dir":
        from timm.models._hub import load_state_dict_from_path  # not re-exported by timm.models

        return load_state_dict_from_path(cfg["file"])
    if cfg.get("source") == "hf-hub":
        extra = [cfg["hf_hub_filename"]] if cfg.get("hf_hub_filename") else []
        return timm.models.load_state_dict_from_hf(cfg["hf_hub_id"], *extra, **_cache(cache_dir))
    if cfg.get("file"):
        return timm.models.load_state_dict(str(cfg["file"]))
    return None


#: one layer's marker as a checkpoint holds it: the codes and the fixed mixing ``(a, b)`` (None without).
Marker = tuple[list[int], Optional[tuple[float, float]]]


def _markers(state: dict[str, torch.Tensor]) -> dict[str, Marker]:
    """Layer name -> marker of every marked layer of a state dict."""
    out: dict[str, Marker] = {}
    for k, v in state.items():
        if (k == MARKER or k.endswith("." + MARKER)) and isinstance(v, torch.Tensor):
            layer = k[: -len(MARKER)].rstrip(".")
            coef = state.get(f"{layer}.{COEF}" if layer else COEF)
            out[layer] = ([int(c) for c in v.tolist()], decode_coef(coef) if isinstance(coef, torch.Tensor) else None)
    return out


def _saved_anchors(state: dict[str, torch.Tensor], markers: dict[str, Marker]) -> dict[str, str]:
    """Marked layer -> key of its anchor saved with a leading axis of 1 (see ``_layers.anchor_of``): under
    the layer's ``proj.``, the tensor of two or more axes whose first has size 1 (a projection has more
    than one output)."""
    out = {}
    for layer in markers:
        head = f"{layer}.proj." if layer else "proj."
        for k, v in state.items():
            if k.startswith(head) and isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == 1:
                out[layer] = k
                break
    return out


def stock_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """A state dict of a model with Laplacian heads in the form a stock timm model loads: the markers and
    mixing dropped, each layer's anchor (its output projection's weight, saved with a leading axis of 1 so
    that plain timm refuses the file) back in its own shape. The stock model computes standard heads: use it
    to compare, or to start from the weights on purpose.

    Args:
        state: ``model.state_dict()`` or a file's tensors (``timm.models.load_state_dict(path)``).

    Returns:
        a new dict; the tensors are the same (or views of them).
    """
    anchors = set(_saved_anchors(state, _markers(state)).values())
    return {k: (v.squeeze(0) if k in anchors else v) for k, v in state.items() if not _LAPLACIAN_KEY.search(k)}


def _agrees(layer: LaplacianLayer, saved: Marker, before: bool) -> bool:
    """Whether a layer's heads are the ones a marker describes; ``before``: the file was written before fixed
    mixing had a code of its own (its heads were marked Laplacian, see ``LaplacianLayer._load_from_state_dict``)."""
    codes, coef = saved
    own = layer.laplacian_codes()
    if before and codes == [MIX_LAPLACIAN if c == MIX_FIXED else c for c in own]:
        return True
    return codes == own and (MIX_FIXED not in own or coef == layer.laplacian_coef())


def _disagreeing(model: nn.Module, markers: dict[str, Marker], before: set[str]) -> list[str]:
    """The marked layers whose heads are not the marker's (a marked layer the model lacks included)."""
    layers = dict(laplacian_attention_layers(model))
    return [
        n
        for n, m in markers.items()
        if not isinstance(layers.get(n), LaplacianLayer) or not _agrees(cast(LaplacianLayer, layers[n]), m, n in before)
    ]


def _selection_from_markers(model: nn.Module, markers: dict[str, Marker]) -> Any:
    """The selection that rebuilds the checkpoint's heads: an int k if it can, ``"learn"``, a fixed mixing
    ``"mix(a,b):k"``, else per-layer indices."""
    layers = laplacian_attention_layers(model)
    unknown = sorted(set(markers) - {n for n, _ in layers})
    if unknown:
        raise ConfigError(
            f"the checkpoint marks Laplacian layers this model does not have ({', '.join(unknown[:3])}); "
            "build the architecture it was saved from"
        )
    codes = [markers.get(n, ([MIX_STANDARD] * _heads_of(m), None))[0] for n, m in layers]
    learn = [all(c == MIX_LEARNABLE for c in cs) for cs in codes]
    if all(learn):
        return "learn"
    if any(learn):
        raise ConfigError(
            "the checkpoint has learnable mixing in some layers and fixed heads in others, which no "
            "laplacian_heads setting rebuilds; give laplacian_heads and load its mixing yourself"
        )
    fixed = [any(c == MIX_FIXED for c in cs) for cs in codes]
    on = MIX_FIXED if any(fixed) else MIX_LAPLACIAN
    indices = [[h for h, c in enumerate(cs) if c == on] for cs in codes]
    ks = {len(i) for i in indices}
    trailing = len(ks) == 1 and all(i == list(range(len(cs) - len(i), len(cs))) for i, cs in zip(indices, codes))
    if on == MIX_FIXED:
        coefs = {markers[n][1] for (n, _), f in zip(layers, fixed) if f}
        if not trailing or any(MIX_LAPLACIAN in cs for cs in codes) or len(coefs) != 1 or None in coefs:
            raise ConfigError(
                "the checkpoint's fixed mixing heads (an ablation) differ between layers or sit among Laplacian "
                "heads, which no laplacian_heads setting rebuilds; give laplacian_heads and set the layers yourself"
            )
        coef = coefs.pop()
        assert coef is not None
        return f"mix({coef[0]!r},{coef[1]!r}):{ks.pop()}"
    if trailing:
        return ks.pop()
    return indices


def _pretrained_cfg(model: nn.Module) -> dict[str, Any]:
    return dict(model.__dict__.get("pretrained_cfg") or {})


def _set_pretrained_cfg(model: nn.Module, cfg: dict[str, Any]) -> None:
    """timm's ``pretrained_cfg`` and its alias ``default_cfg``: plain attributes, not submodules."""
    object.__setattr__(model, "pretrained_cfg", cfg)
    object.__setattr__(model, "default_cfg", cfg)


def _create(
    name: str, base: str, laplacian_heads: HeadSpec, timm_kwargs: dict[str, Any], *, replaces: bool
) -> nn.Module:
    """timm builds the stock model and loads the stock part of the weights; the model is converted; then
    the markers and mixing load. ``replaces``: the caller's heads replace the checkpoint's markers."""
    kw = dict(timm_kwargs)
    pretrained = bool(kw.pop("pretrained", False))
    cfg_arg, overlay = kw.pop("pretrained_cfg", None), kw.pop("pretrained_cfg_overlay", None)
    checkpoint_path = kw.pop("checkpoint_path", None)
    user_cfg = dict(cfg_arg) if isinstance(cfg_arg, dict) else {}
    saved_spec = user_cfg.pop("laplacian_heads", None)
    named = {**user_cfg, **(overlay or {})}
    state = _named_weights(named, kw.get("cache_dir")) if pretrained else None
    _, k = _split_lap_name(name)
    if pretrained and state is None and k is not None:
        raise ConfigError(
            f"no pretrained weights exist for {name!r}; use pretrained=False, or start from the baseline weights "
            f"with lapheads.timm.create_model({base!r}, pretrained=True, laplacian_heads={k}), or load a saved "
            f"checkpoint with pretrained_cfg_overlay=dict(file=PATH) or a local-dir: / hf-hub: name"
        )
    lap: dict[str, torch.Tensor] = {}
    if state is not None:  # the stock part loads through timm, the Laplacian part (markers, mixing) after converting
        lap = {k: v for k, v in state.items() if _LAPLACIAN_KEY.search(k)}
        overlay = {**(overlay or {}), **dict.fromkeys(_WEIGHT_SOURCE_KEYS), "state_dict": stock_state_dict(state)}
    model = timm.create_model(
        base,
        pretrained=pretrained,
        pretrained_cfg=user_cfg if isinstance(cfg_arg, dict) else cfg_arg,
        pretrained_cfg_overlay=overlay,
        **kw,
    )
    if state is not None:  # the weights' source as the caller named it, not the in-memory copy
        cfg = {k: v for k, v in _pretrained_cfg(model).items() if k not in _WEIGHT_SOURCE_KEYS}
        cfg.update({k: named[k] for k in _WEIGHT_SOURCE_KEYS if k != "state_dict" and named.get(k) is not None})
        _set_pretrained_cfg(model, cfg)
    if k is not None:  # a registered variant: its own name, whatever timm built it from
        _set_pretrained_cfg(model, dict(_pretrained_cfg(model), architecture=name))
    loaded = timm.models.load_state_dict(str(checkpoint_path)) if checkpoint_path else None
    source = loaded if loaded is not None else (state or {})
    markers = _markers(source)
    anchors = _saved_anchors(source, markers)
    before = {n for n, (codes, _) in markers.items() if any(codes) and n not in anchors}  # files of older releases
    spec: Any = laplacian_heads if laplacian_heads is not None else saved_spec
    try:
        convert(model, spec)
        if laplacian_heads is None and markers and _disagreeing(model, markers, before):
            convert(model, _selection_from_markers(model, markers))
    except ConfigError as e:
        raise ConfigError(f"model {name!r}: {e}") from None
    own = model.state_dict()
    keep = not replaces
    if lap:
        left = sorted(set(lap) - set(own))
        if keep and left:
            raise ConfigError(
                f"model {name!r}: the checkpoint has Laplacian entries this model has no place for "
                f"({', '.join(left[:3])}); build the architecture it was saved from"
            )
        wrong = _disagreeing(model, markers, before) if keep else []
        if wrong:  # heads that differ from the checkpoint's (a _lap<k> name's k, or markers no setting rebuilds)
            layer = cast(LaplacianLayer, model.get_submodule(wrong[0]))
            raise ConfigError(f"model {name!r}: {layer.laplacian_mismatch(wrong[0], *markers[wrong[0]])}")
        model.load_state_dict({k: v for k, v in lap.items() if is_mix_param(k) and k in own}, strict=False)
    if loaded is not None:  # timm.models.load_checkpoint's strict load, into the converted model
        model.load_state_dict(
            {k: v for k, v in loaded.items() if keep or not _LAPLACIAN_KEY.search(k) or (k in own and is_mix_param(k))},
            strict=True,
        )
    return model


def _make_entrypoint(base: str, k: int):
    name = f"{base}_lap{k}"

    def entrypoint(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        # timm.create_model hands pretrained_cfg / overlay / cache_dir to every entrypoint; a
        # pretrained_cfg read from a saved model (local-dir:, hf-hub:) or an overlay naming a file
        # points at Laplacian weights, which load; without such a source there are no weights.
        if not pretrained:
            for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir", "pretrained_model_args"):
                kwargs.pop(key, None)
        model = _create(name, base, k, dict(kwargs, pretrained=pretrained), replaces=False)
        if not pretrained:
            _set_pretrained_cfg(model, dict(_pretrained_cfg(model), tag=None, hf_hub_id=None, url="", file=None))
        return model

    entrypoint.__name__ = entrypoint.__qualname__ = name
    entrypoint.__module__ = _PACKAGE
    entrypoint.__doc__ = (
        f"timm {base} with the trailing {k} heads of every layer Laplacian (pretrained: only from a saved checkpoint)."
    )
    return entrypoint


def register_variants() -> None:
    """Register every ``<base>_lap<k>`` entrypoint with timm, as attributes of ``lapheads.timm``."""
    mod = sys.modules[_PACKAGE]
    for base, n_heads in VARIANT_BASES.items():
        for k in range(1, n_heads + 1):
            fn = _make_entrypoint(base, k)
            setattr(mod, fn.__name__, fn)  # timm's register_model looks the function up in its module
            if fn.__name__ not in timm.models._registry._model_entrypoints:
                timm.models.register_model(fn)
            REGISTERED_MODELS.append(fn.__name__)
