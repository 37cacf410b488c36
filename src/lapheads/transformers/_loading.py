"""Giving a model Laplacian heads (:func:`enable`) and loading a checkpoint with them (:func:`from_pretrained`)."""

from __future__ import annotations

import json
import logging as _logging
import os
from typing import Any, Callable, Optional, Union, cast

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion
from transformers.utils import cached_file
from transformers.utils import logging as hf_logging

from ..errors import ConfigError
from ..heads import MIX_PARAM_SUFFIXES, LaplacianHeads, learnable_spec, register_mix, remove_mix
from ._configs import (
    check_implementation,
    config_spec,
    config_tree,
    fused_implementation,
    layer_selections,
    learnable,
    model_class_supports_sdpa,
)
from ._format import WEIGHTS_KEY, is_laplacian_checkpoint, strip_config
from ._indexing import Entry, attention_modules, module_heads, module_selection, plain_load_reproduces, write_index
from ._names import ATTN_IMPLEMENTATION, BASE, EAGER_ATTN_IMPLEMENTATION, FUSED_ATTN_IMPLEMENTATION, MODEL_TYPE_PREFIX
from ._registry import register_model_type
from ._saving import hook_push, mark_config


def _specs_for(configs: list[tuple[str, Any]], laplacian_heads: Any, owner: str) -> dict[int, Any]:
    """id(config) -> the spec (``to_config`` form) each config with layers gets from ``laplacian_heads``."""
    if isinstance(laplacian_heads, dict):
        paths = {p or '""' for p, _ in configs}
        unknown = sorted(set(laplacian_heads) - {p for p, _ in configs})
        if unknown:
            raise ConfigError(
                f"enable({owner}, {{...}}): no attention layers see the config(s) {unknown}; "
                f"the configs with layers are {sorted(paths)}"
            )
        return {id(c): LaplacianHeads(laplacian_heads.get(p, 0)).to_config() for p, c in configs}
    spec = LaplacianHeads(laplacian_heads).to_config()
    return {id(c): spec for _, c in configs}


def _enable_config(config: PreTrainedConfig, laplacian_heads: Any, eager: bool) -> PreTrainedConfig:
    """:func:`enable` for a config alone: every config of its tree that has layers gets its spec."""
    tree = config_tree(config)
    with_layers = [
        (p, c)
        for p, c in tree
        if isinstance(getattr(c, "num_hidden_layers", None), int)
        and isinstance(getattr(c, "num_attention_heads", None), int)
    ] or tree[:1]
    # raise now if k > heads or the list length != layers
    _set_specs(
        with_layers, laplacian_heads, type(config).__name__, lambda: [layer_selections(c) for _, c in with_layers]
    )
    fused = fused_implementation(config)
    config._attn_implementation = EAGER_ATTN_IMPLEMENTATION if eager else fused
    for _, c in tree:
        mark_config(c, needs_index=False, fused=fused)
    return config


def _set_specs(configs: list[tuple[str, Any]], laplacian_heads: Any, owner: str, check: Callable[[], Any]) -> None:
    """Set each config's spec, then ``check()``; a ConfigError puts the old specs back."""
    specs = _specs_for(configs, laplacian_heads, owner)
    old = {id(c): config_spec(c) for _, c in configs}
    try:
        for _, c in configs:
            c.laplacian_heads = specs[id(c)]
        check()
    except ConfigError:
        for _, c in configs:
            c.laplacian_heads = old[id(c)]
        raise


def _spec_configs(entries: list[Entry]) -> list[tuple[str, Any]]:
    """``(path, config)`` of each distinct config the self-attention modules of ``entries`` read, in order."""
    configs: list[tuple[str, Any]] = []
    for e in entries:
        if not e.cross and all(c is not e.config for _, c in configs):
            configs.append((e.config_path, e.config))
    return configs


def _runs_eager(model: PreTrainedModel) -> bool:
    return BASE.get(model.config._attn_implementation or "") == EAGER_ATTN_IMPLEMENTATION


def _validate_stacks(entries: list[Entry], owner: str) -> None:
    """Resolve each stack's spec now, so a bad spec is refused by enable() and not at the first forward."""
    seen: set[tuple[str, int]] = set()
    for e in entries:
        if e.cross or (e.stack, id(e.config)) in seen:
            continue
        seen.add((e.stack, id(e.config)))
        n_heads = module_heads(e.module)
        if n_heads is None:
            continue  # resolved against the real head count at the first forward
        plain = (
            getattr(e.module, "layer_idx", None) == e.layer
            and getattr(e.config, "num_hidden_layers", None) == e.n_layers
        )
        try:
            layer_selections(e.config, n_heads, e.n_layers)
        except ConfigError as err:
            if plain:
                raise  # a decoder: the message it always had
            where = f"{owner}.{e.stack}" if e.stack else owner
            raise ConfigError(f"{where} ({e.n_layers} layers of {n_heads} heads): {err}") from None


def enable(
    model_or_config: Union[PreTrainedModel, PreTrainedConfig], laplacian_heads: Any, eager: bool = False
) -> Union[PreTrainedModel, PreTrainedConfig]:
    """Give a model (or a config before the model is built) Laplacian heads, in one call.

    A learnable spec registers ``lap_mix_a`` / ``lap_mix_b`` on every self-attention module: create
    the optimizer after this call. A config alone gets no parameters: build the model from it, then
    call ``enable(model, spec)``.

    Args:
        model_or_config: a transformers ``PreTrainedModel`` or its config.
        laplacian_heads: anything :class:`lapheads.LaplacianHeads` accepts, the same for every stack;
            or, for a composite model, a dict from sub-config path (``"vision_config"``, ``""`` for
            the top config) to such a spec (a config not named: none).
        eager: use :data:`EAGER_ATTN_IMPLEMENTATION` (returns the operator as attentions).

    Returns:
        ``model_or_config``, modified in place.

    Raises:
        ConfigError: not a transformers model or config, a model without attention modules that
            dispatch through ``AttentionInterface``, or a spec that does not fit a stack.
    """
    is_model = isinstance(model_or_config, PreTrainedModel)
    config = model_or_config.config if is_model else model_or_config
    if not isinstance(config, PreTrainedConfig):
        raise ConfigError(
            f"enable() needs a transformers PreTrainedModel or PreTrainedConfig, got {type(model_or_config).__name__}"
        )
    if not is_model:
        return _enable_config(config, laplacian_heads, eager)
    model = cast(PreTrainedModel, model_or_config)
    owner = type(model).__name__
    entries = attention_modules(model)
    selfs = [e for e in entries if not e.cross]
    if not selfs:
        raise ConfigError(
            f"{owner} has no self-attention module that dispatches through transformers' "
            "AttentionInterface, so it cannot get Laplacian heads"
        )
    configs = _spec_configs(selfs)
    _set_specs(configs, laplacian_heads, owner, lambda: _validate_stacks(selfs, owner))
    for e in selfs:
        learn = learnable_spec(e.config.laplacian_heads)
        if learn is not None:
            n_heads = module_heads(e.module)
            if n_heads is None:
                raise ConfigError(f"{owner}.{e.name}: the head count is unknown, so it cannot hold learnable mixing")
            register_mix(e.module, learn.init_selection(e.n_layers, n_heads)[e.layer])
        else:
            remove_mix(e.module)
    write_index(model, entries)
    fused = fused_implementation(model)
    model.set_attn_implementation(EAGER_ATTN_IMPLEMENTATION if eager else fused)
    needs_index = not plain_load_reproduces(entries)
    for _, c in config_tree(config) + configs:
        mark_config(c, needs_index=needs_index, fused=fused)
    # Each layer's laplacian_selection is readable now, resolved under the implementation the model
    # runs, so its first forward (compiled or not) finds it current and changes nothing.
    for e in selfs:
        n_heads = module_heads(e.module)
        if n_heads is not None:
            module_selection(e.module, n_heads)
    hook_push(model)
    return model


# keyword arguments of from_pretrained that say where a hub checkpoint's files are
_HUB_KWARGS = ("cache_dir", "revision", "token", "local_files_only", "subfolder", "force_download", "proxies")


def _checkpoint_files(path: str, **hub: Any) -> list[str]:
    """The safetensors files of a checkpoint: a local directory, or a hub id resolved by transformers' ``cached_file``."""

    def find(name: str) -> Optional[str]:
        if os.path.isdir(path):
            f = os.path.join(path, hub.get("subfolder") or "", name)
            return f if os.path.isfile(f) else None
        return cached_file(
            path,
            name,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
            **hub,
        )

    index = find("model.safetensors.index.json")
    if index:
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [find(name) for name in shards]
        return [f for f in files if f]
    single = find("model.safetensors")
    return [single] if single else []


def _load_mixing(model: PreTrainedModel, path: str, **hub: Any) -> None:
    """Register the mixing parameters on ``model`` and fill them from the checkpoint at ``path``
    (a directory or a hub id; ``hub``: where ``from_pretrained`` was told to look)."""

    enable(model, _current_spec(model), eager=_runs_eager(model))
    wanted = {n: p for n, p in model.named_parameters() if n.endswith(MIX_PARAM_SUFFIXES)}
    keys = {n: _checkpoint_keys(model, n, p) for n, p in wanted.items()}
    by_key = {k: n for n, ks in keys.items() for k in ks}
    found: dict[str, torch.Tensor] = {}
    for file in _checkpoint_files(path, **hub):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key in by_key:
                    found[by_key[key]] = f.get_tensor(key)
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ConfigError(
            f"{path}: config.laplacian_heads={_current_spec(model)!r} is learnable mixing, but "
            f"the checkpoint lacks {len(missing)} of its parameters (e.g. {keys[missing[0]][0]}); it was not "
            "saved from a model with learnable mixing"
        )
    with torch.no_grad():
        for n, p in wanted.items():
            p.copy_(found[n].to(p.dtype))


def _checkpoint_keys(model: PreTrainedModel, name: str, param: torch.Tensor) -> list[str]:
    """The keys a model parameter may have in a checkpoint file: the name ``save_pretrained`` gives it
    (after reverse weight conversion), with and without the base model's prefix."""
    saved = list(revert_weight_conversion(model, {name: param}))
    key = saved[0] if len(saved) == 1 else name
    prefix = getattr(model, "base_model_prefix", "") or ""
    out = [key]
    if prefix:
        out += [key[len(prefix) + 1 :]] if key.startswith(prefix + ".") else [f"{prefix}.{key}"]
    return out


def _current_spec(model: PreTrainedModel) -> Any:
    """The spec of a model as :func:`enable` takes it: one value, or a dict per sub-config when they differ."""
    configs = _spec_configs(attention_modules(model))
    if not configs:
        return config_spec(model.config)
    specs = [config_spec(c) for _, c in configs]
    if all(repr(s) == repr(specs[0]) for s in specs):
        return specs[0] if specs[0] is not None else 0
    return {p: (s if s is not None else 0) for (p, _), s in zip(configs, specs)}


class _OtherModelType(_logging.Filter):
    """Drops transformers' warning that a concrete class reads a config of another model type: the type of a
    checkpoint with Laplacian heads is its base type with a prefix, which that class builds exactly."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return f"a model of type `{MODEL_TYPE_PREFIX}" not in record.getMessage()


def from_pretrained(path: str, model_class: Any = None, eager: bool = False, **kwargs: Any) -> PreTrainedModel:
    """``model_class.from_pretrained`` with the Laplacian attention implementation by name, indexed.

    The heads come from the saved config's ``laplacian_heads`` (or ``kwargs["config"]``).

    Args:
        path: a directory written by ``save_pretrained``, or a hub id (resolved like
            ``from_pretrained`` does: the local cache, ``cache_dir``, ``revision``, offline mode).
        model_class: default ``AutoModelForCausalLM``; any transformers model class (``AutoModel``,
            ``ViTForImageClassification``, ``CLIPVisionModel``, ...).
        eager: pick :data:`EAGER_ATTN_IMPLEMENTATION`.
        **kwargs: passed to ``from_pretrained``.

    Raises:
        ConfigError: an explicit standard ``attn_implementation`` for a config with Laplacian heads
            (:func:`check_implementation`), or learnable mixing missing from the checkpoint.
    """

    model_class = model_class or AutoModelForCausalLM
    config = kwargs.get("config")
    laplacian_format = False
    if not isinstance(config, PreTrainedConfig):
        hub = {k: v for k, v in kwargs.items() if k in _HUB_KWARGS}
        raw, _ = PreTrainedConfig.get_config_dict(config or path, **hub)
        laplacian_format = is_laplacian_checkpoint(raw)
        if laplacian_format:  # a model type registered after lapheads.transformers was imported
            register_model_type(raw["model_type"][len(MODEL_TYPE_PREFIX) :])
        config_kwargs = {k: v for k, v in kwargs.items() if k == "laplacian_heads"}
        config = AutoConfig.from_pretrained(config or path, **hub, **config_kwargs)
    if laplacian_format and not hasattr(model_class, "_model_mapping"):
        # A concrete class reads config.json itself, and the file's weights name refuses it: the keyword
        # overrides that name (transformers' own override of a config value), and strip_config removes it.
        kwargs[WEIGHTS_KEY] = None
    has_spec = any(config_spec(c) is not None for _, c in config_tree(config))
    fused = ATTN_IMPLEMENTATION if model_class_supports_sdpa(model_class, config) else FUSED_ATTN_IMPLEMENTATION
    if "attn_implementation" in kwargs:
        check_implementation(config, kwargs["attn_implementation"])
        base = BASE.get(kwargs["attn_implementation"] or "")
        if base is not None:  # one of ours, saved alias or not: the registered name this class takes
            kwargs["attn_implementation"] = EAGER_ATTN_IMPLEMENTATION if base == EAGER_ATTN_IMPLEMENTATION else fused
    elif has_spec:
        kwargs["attn_implementation"] = EAGER_ATTN_IMPLEMENTATION if eager else fused
    learn = any(learnable(c) for _, c in config_tree(config))
    # transformers warns that lap_mix_* are unexpected keys (its freshly built model lacks them);
    # _load_mixing restores them right after, so that warning would be wrong here.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(_logging.ERROR if learn else level)
    quiet = _OtherModelType()
    config_logger = _logging.getLogger("transformers.configuration_utils")
    config_logger.addFilter(quiet)
    try:
        model = model_class.from_pretrained(path, **kwargs)
    finally:
        config_logger.removeFilter(quiet)
        hf_logging.set_verbosity(level)
    strip_config(model.config)
    if learn:
        _load_mixing(model, path, **{k: kwargs[k] for k in _HUB_KWARGS if k in kwargs})
    elif has_spec and any(not e.cross for e in attention_modules(model)):
        enable(model, _current_spec(model), eager=_runs_eager(model))
    mark_config(model.config)
    return model
