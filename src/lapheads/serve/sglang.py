"""SGLang's general plugin: a model with Laplacian heads is refused, never served as standard attention.

SGLang's Transformers backend builds the transformers model with ``config._attn_implementation =
"sglang"`` (its RadixAttention), and its native model code never calls transformers' attention, so on
either path a Laplacian model would run standard attention in every head, with no error. lapheads.serve
does not serve Laplacian heads in SGLang; :func:`register` (the ``sglang.srt.plugins`` entry point, run
in each SGLang process) hooks SGLang's ``ModelConfig`` so that reading such a model's config fails with
one line naming the way to serve it (vLLM, docs/serving.md).

SGLang logs, and does not raise, an error of a plugin or of applying its hook; so :func:`register` first
checks that the hooked constructor exists, and the refusal itself happens when SGLang reads a config.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .checks import served_heads

#: The SGLang constructor that reads a model's transformers config (the hook's target).
MODEL_CONFIG_INIT = "sglang.srt.configs.model_config.ModelConfig.__init__"


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: refuse Laplacian models when SGLang reads their config."""
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    import lapheads.transformers  # noqa: F401 - before SGLang reads a config: the Auto classes and attention names

    owner, _, name = MODEL_CONFIG_INIT.rpartition(".")
    getattr(pkgutil.resolve_name(owner), name)  # an SGLang without it: fail here, loudly in SGLang's log
    HookRegistry.register(MODEL_CONFIG_INIT, refuse_laplacian, HookType.AFTER)


def refuse_laplacian(result: Any, model_config: Any, *args: Any, **kwargs: Any) -> None:
    """The hook run after SGLang's ``ModelConfig(...)``: refuse a model with Laplacian heads."""
    for config in (getattr(model_config, "hf_text_config", None), getattr(model_config, "hf_config", None)):
        heads = served_heads(config) if config is not None else None
        if heads is not None:
            raise ConfigError(
                f"{getattr(model_config, 'model_path', 'this model')}: laplacian_heads={heads.spec!r} is not served "
                "by SGLang (its Transformers backend replaces the attention with its own and its native models "
                "ignore the heads, so every head would be standard): serve it with vLLM and lapheads[serve] "
                "(docs/serving.md) or run it with lapheads.transformers"
            )
