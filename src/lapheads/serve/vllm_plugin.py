"""vLLM's general plugin: Laplacian heads served through vLLM's Transformers backend, or a one-line refusal.

vLLM's Transformers backend builds the transformers model with ``config._attn_implementation = "vllm"``,
so the Laplacian attention functions ``lapheads.transformers`` registers are never called there, and its
native model code (``--model-impl vllm``) never calls transformers' attention at all. :func:`register`
(the ``vllm.general_plugins`` entry point, run in every vLLM process before a config is read) therefore:

1. refuses a vLLM release outside :data:`lapheads.serve.checks.TESTED_VLLM`;
2. imports ``lapheads.transformers`` (transformers' Auto classes then read Laplacian checkpoints);
3. registers :data:`ATTN_IMPLEMENTATION` in transformers' ``AttentionInterface``: vLLM's own ``"vllm"``
   function (paged attention, KV cache, every backend), then the rank's heads on its output
   (:func:`lapheads.serve.rank_heads.apply_rank_heads`);
4. wraps vLLM's model registry: a model with Laplacian heads gets ``model_impl="transformers"`` (``"auto"``
   becomes it, anything else is refused) and must resolve to a served Transformers-backend class;
5. wraps the backend's ``_create_attention_instances`` (where vLLM attaches its attention layer to each
   transformers attention module): for a model with Laplacian heads it checks the parallel layout, gives
   each module its rank's slice of the head selection (or registers the rank's slice of ``lap_mix_a`` /
   ``lap_mix_b``, which vLLM's weight loader then fills from the checkpoint), and switches the model to
   :data:`ATTN_IMPLEMENTATION`. A model without Laplacian heads is left exactly as vLLM built it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch

from ..errors import ConfigError
from ..heads import MIX_PARAM_SUFFIXES, HeadMix
from .checks import (
    ServedHeads,
    check_attention_kind,
    check_parallel,
    check_served_class,
    check_vllm_version,
    model_impl,
    served_heads,
)
from .rank_heads import apply_rank_heads, check_tensor_parallel, rank_selection

#: The attention implementation a served Laplacian model runs: vLLM's attention, then the heads.
ATTN_IMPLEMENTATION = "lapheads_vllm"
#: The attribute of a transformers attention module that holds its rank's heads (a plain attribute, never saved).
RANK_HEADS_ATTR = "lapheads_rank_heads"
#: The value of :data:`RANK_HEADS_ATTR` for learnable mixing (the module holds the rank's ``lap_mix_a`` / ``lap_mix_b``).
LEARNABLE = "learnable"

#: under vLLM's logger, whose handler vLLM configures
_log = logging.getLogger("vllm").getChild("lapheads")
_done = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: hook vLLM once per process (see the module docstring).

    Raises:
        ConfigError: the installed vLLM is outside the tested releases.
    """
    global _done
    if _done:
        return
    import vllm

    check_vllm_version(vllm.__version__)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.model_executor.models.transformers import base  # registers vLLM's "vllm" attention function

    import lapheads.transformers  # noqa: F401 - before vLLM reads a config: the Auto classes and attention names

    ALL_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, laplacian_attention(ALL_ATTENTION_FUNCTIONS["vllm"]))
    for name in ("inspect_model_cls", "resolve_model_cls"):
        setattr(ModelRegistry, name, _guard_resolution(getattr(ModelRegistry, name), name == "inspect_model_cls"))
    base.Base._create_attention_instances = _prepare_after(base.Base._create_attention_instances)
    _done = True


def laplacian_attention(vllm_forward: Callable[..., Any]) -> Callable[..., Any]:
    """The attention function of :data:`ATTN_IMPLEMENTATION`: ``vllm_forward`` (vLLM's ``"vllm"`` function), then
    the calling module's heads on its output, with ``value`` (the step's tokens) as the identity term."""

    def forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        out, weights = vllm_forward(module, query, key, value, attention_mask, **kwargs)
        heads = getattr(module, RANK_HEADS_ATTR, None)
        if heads is None:
            raise ConfigError(
                f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) runs {ATTN_IMPLEMENTATION!r} "
                "but lapheads.serve gave it no heads: vLLM built it outside the Transformers backend's attention layers"
            )
        if heads == LEARNABLE:
            heads = HeadMix(*(getattr(module, name) for name in MIX_PARAM_SUFFIXES))
        return apply_rank_heads(out, value, heads), weights

    return forward


def config_heads(model_config: Any) -> ServedHeads | None:
    """The Laplacian heads of the model vLLM's ``ModelConfig`` describes (None: none), refusing a checkpoint whose
    heads need lapheads' own layer index (its saved attention implementation says so)."""
    from ..transformers import INDEXED_ATTN_IMPLEMENTATION_SUFFIX

    text = model_config.hf_text_config
    heads = served_heads(text)
    if model_config.hf_config is not text:
        heads = heads or served_heads(model_config.hf_config)
    if heads is not None and str(getattr(text, "_attn_implementation", "")).endswith(
        INDEXED_ATTN_IMPLEMENTATION_SUFFIX
    ):
        raise ConfigError(
            f"{model_config.model}: its Laplacian heads need lapheads' layer index (the modules do not carry their "
            "own layer numbers), which vLLM's Transformers backend does not build: serve it with lapheads.transformers"
        )
    return heads


def _guard_resolution(method: Callable[..., Any], inspect: bool) -> Callable[..., Any]:
    """``ModelRegistry.inspect_model_cls`` / ``resolve_model_cls`` that serve a Laplacian model through the
    Transformers backend or refuse it."""
    if getattr(method, "_lapheads", False):
        return method

    @functools.wraps(method)
    def resolve(architectures: Any, model_config: Any, *args: Any, **kwargs: Any) -> Any:
        heads = config_heads(model_config)
        if heads is not None:
            impl = model_impl(model_config.model_impl, heads)
            if str(getattr(model_config.model_impl, "value", model_config.model_impl)) != impl:
                _log.info(
                    "laplacian_heads=%r: serving with model_impl=%r (vLLM's own code ignores them)", heads.spec, impl
                )
                model_config.model_impl = impl
        result = method(architectures, model_config, *args, **kwargs)
        if heads is not None:
            resolved = result[0].architecture if inspect else result[0].__name__
            check_served_class(resolved, model_config._get_transformers_backend_cls(), heads)
        return result

    resolve._lapheads = True  # type: ignore[attr-defined]
    return resolve


def _prepare_after(method: Callable[..., Any]) -> Callable[..., Any]:
    """The backend's ``_create_attention_instances``, then :func:`prepare`."""
    if getattr(method, "_lapheads", False):
        return method

    @functools.wraps(method)
    def create(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        prepare(self)
        return result

    create._lapheads = True  # type: ignore[attr-defined]
    return create


def prepare(model: Any) -> None:
    """Give each attention module of a vLLM Transformers-backend model its rank's heads (see the module docstring).

    Args:
        model: the backend's model (``vllm.model_executor.models.transformers.base.Base``), its attention
            layers created and its weights not yet loaded.

    Raises:
        ConfigError: a layout the plugin cannot serve exactly (the message says which and the fix).
    """
    from ..transformers import attention_modules, mixing_modules

    text = model.text_config
    heads = served_heads(text)
    if model.config is not text:
        heads = heads or served_heads(model.config)
    if heads is None:
        return
    check_served_class(type(model).__name__, model.model_config._get_transformers_backend_cls(), heads)
    pc = model.parallel_config
    check_parallel(
        pc.tensor_parallel_size,
        pc.pipeline_parallel_size,
        pc.decode_context_parallel_size,
        pc.prefill_context_parallel_size,
    )
    check_attention_kind(getattr(text, "_attn_implementation", None))
    if heads.learnable and model.quant_config is not None:
        raise ConfigError(
            f"laplacian_heads={heads.spec!r} (learnable mixing) with quantization={model.quant_config.get_name()!r}: "
            "vLLM does not check that a quantized model's checkpoint filled every parameter, so the mixing could be "
            "left unloaded; serve it unquantized, or fix the heads first (lapheads.suggest_selection)"
        )
    n_heads = int(text.num_attention_heads)
    n_kv = int(getattr(text, "num_key_value_heads", None) or n_heads)
    tp, rank = model.tp_group.world_size, model.tp_group.rank_in_group
    check_tensor_parallel(n_heads, n_kv, tp)
    index = {id(e.module): e for e in attention_modules(model.model) if not e.cross}
    holders = {id(m) for m in mixing_modules(model.model)} if heads.learnable else set()
    for layer, (name, _) in sorted(model.attention_fusers.items()):
        module = model.get_submodule(name)
        attn = module.attn
        entry = index.get(id(module))
        if entry is None or entry.layer != layer:
            raise ConfigError(
                f"{name}: vLLM serves it as layer {layer}, lapheads.transformers indexes it as "
                f"{'nothing' if entry is None else entry.layer}; the heads cannot be placed, serve it with lapheads.transformers"
            )
        if (attn.num_heads, attn.num_kv_heads) != (n_heads // tp, max(1, n_kv // tp)):
            raise ConfigError(
                f"{name}: vLLM's attention layer holds {attn.num_heads} query / {attn.num_kv_heads} KV heads on rank "
                f"{rank} of {tp}, not the {n_heads // tp} / {max(1, n_kv // tp)} the head selection was sliced for"
            )
        if heads.learnable:
            if id(module) not in holders:
                raise ConfigError(f"{name}: lapheads.transformers gives it no learnable mixing, but vLLM serves it")
            _register_rank_mix(model, module, n_heads // tp)
            object.__setattr__(module, RANK_HEADS_ATTR, LEARNABLE)
        else:
            object.__setattr__(module, RANK_HEADS_ATTR, rank_selection(heads.selections[layer], n_kv, tp, rank))
    text._attn_implementation = ATTN_IMPLEMENTATION
    _log.info(
        "lapheads.serve: laplacian_heads=%r on %d layers (tensor-parallel rank %d of %d)",
        heads.spec,
        len(model.attention_fusers),
        rank,
        tp,
    )


def _register_rank_mix(model: Any, module: torch.nn.Module, n_local: int) -> None:
    """Register this rank's ``lap_mix_a`` / ``lap_mix_b`` (``n_local`` heads) for vLLM's weight loader to fill from
    the checkpoint's ``(H,)`` tensors, NaN until then (a parameter left unloaded cannot pass for a trained one)."""
    from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
    from vllm.model_executor.utils import set_weight_attrs

    for name in MIX_PARAM_SUFFIXES:
        data = torch.full((n_local,), float("nan"), dtype=model.model_config.dtype, device=model.device_config.device)
        param = torch.nn.Parameter(data, requires_grad=False)
        set_weight_attrs(param, {"weight_loader": sharded_weight_loader(0)})
        module.register_parameter(name, param)
