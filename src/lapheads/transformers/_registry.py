"""The model types of checkpoints with Laplacian heads in transformers' ``AutoConfig`` (``"lapheads-llama"``, ...)."""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from ..errors import ConfigError
from ._configs import check_implementation, config_tree
from ._format import from_disk
from ._names import MODEL_TYPE_PREFIX
from ._saving import mark_config


class LaplacianCheckpointConfig:
    """What ``AutoConfig`` builds for the model type ``"lapheads-<base>"``: the base model type's own config
    (``LlamaConfig`` for ``"lapheads-llama"``) with its Laplacian heads, marked by :func:`mark_config`.

    Registered for every model type transformers knows when ``lapheads.transformers`` is imported, and
    named by the ``auto_map`` of a saved checkpoint, so ``trust_remote_code=True`` reaches it too.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            "a config with Laplacian heads is the base model's config: build it (e.g. AutoConfig.for_model('llama', "
            "...)) and call lapheads.transformers.enable(config, spec)"
        )

    @classmethod
    def register_for_auto_class(cls, auto_class: Any = "AutoConfig") -> None:
        """transformers calls this on a remote-code config class; this one is registered already."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> Any:
        config_dict, kwargs = PreTrainedConfig.get_config_dict(pretrained_model_name_or_path, **kwargs)
        return cls.from_dict(config_dict, **kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs: Any) -> Any:
        """The base config of ``config_dict`` (``PreTrainedConfig.from_dict``'s arguments and return value).

        Raises:
            ConfigError: ``attn_implementation=`` names a standard implementation (:func:`check_implementation`).
        """
        plain = from_disk(config_dict)
        if plain.get("model_type") not in CONFIG_MAPPING:
            raise ConfigError(
                f"config.json: model_type={config_dict.get('model_type')!r} is a checkpoint with Laplacian heads of the "
                f"model type {plain.get('model_type')!r}, which this transformers does not know "
                "(pip install --upgrade transformers, or register that model type first)"
            )
        base = CONFIG_MAPPING[plain["model_type"]]
        out = base.from_dict(plain, **kwargs)
        config = out[0] if isinstance(out, tuple) else out
        check_implementation(config, kwargs.get("attn_implementation"))
        for _, c in config_tree(config):
            mark_config(c)
        return out


def register_model_type(base: str) -> None:
    """Register ``MODEL_TYPE_PREFIX + base`` (idempotent)."""
    name = MODEL_TYPE_PREFIX + base
    if name not in CONFIG_MAPPING:
        AutoConfig.register(name, LaplacianCheckpointConfig, exist_ok=True)


def register_model_types() -> None:
    """Register the Laplacian model type of every model type transformers knows now."""
    for base in list(CONFIG_MAPPING.keys()):
        if not base.startswith(MODEL_TYPE_PREFIX):
            register_model_type(base)
