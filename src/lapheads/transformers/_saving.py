"""What a config with Laplacian heads writes when it is saved: ``attn_implementation``, the checkpoint format of
``_format`` (with its loader file) and the model card (design: docs/architecture.md)."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Optional

from transformers import PreTrainedConfig

from ..errors import ConfigError
from ._card import remove_card, write_card
from ._configs import fused_implementation, tree_any_laplacian
from ._format import LOADER_FILE, LOADER_SOURCE, to_disk
from ._names import (
    BASE,
    EAGER_ATTN_IMPLEMENTATION,
    INDEXED_ATTN_IMPLEMENTATION_SUFFIX,
    is_laplacian_implementation,
    saved_name,
)

#: the config attribute that ``config.json`` serialises as ``"attn_implementation"``
SAVED_KEY = "attn_implementation"


def _saved_implementation(config: Any, needs_index: Optional[bool], fused: Optional[str]) -> Optional[str]:
    """The ``attn_implementation`` ``config.json`` gets (None: none; an invalid spec is the model's to report)."""
    try:
        if not tree_any_laplacian(config):
            return None
    except ConfigError:
        return None
    current = config.__dict__.get(SAVED_KEY)
    current = current if is_laplacian_implementation(current) else None
    if needs_index is None:
        needs_index = current is not None and current.endswith(INDEXED_ATTN_IMPLEMENTATION_SUFFIX)
    base = BASE.get(getattr(config, "_attn_implementation", None) or "")
    if base is None:
        previous = BASE.get(current or "")
        base = fused or (previous if previous != EAGER_ATTN_IMPLEMENTATION else None) or fused_implementation(config)
    return saved_name(base, needs_index)


def _has_heads(config: Any) -> bool:
    try:
        return tree_any_laplacian(config)
    except ConfigError:  # an invalid spec: saved in the Laplacian format, the model reports the spec
        return True


def write_beside(directory: str, config: Any, repo_id: Optional[str] = None) -> None:
    """The loader file and the model card beside a saved ``config.json`` (removed again, where lapheads wrote
    them, when the config has no Laplacian heads)."""
    loader = os.path.join(directory, LOADER_FILE)
    if _has_heads(config):
        with open(loader, "w", encoding="utf-8") as f:
            f.write(LOADER_SOURCE)
        write_card(directory, config, repo_id=repo_id)
        return
    if os.path.isfile(loader):
        with open(loader, encoding="utf-8") as f:
            ours = f.read() == LOADER_SOURCE
        if ours:
            os.remove(loader)
    remove_card(directory)


# The methods of the config class that a config with Laplacian heads gets (see saving_class).
def _to_json_file(self: Any, json_file_path: Any, use_diff: bool = True) -> None:
    type(self).lapheads_base.to_json_file(self, json_file_path, use_diff=use_diff)
    with open(json_file_path, encoding="utf-8") as f:
        saved = json.load(f)
    written = to_disk(saved)
    if written is not saved:
        with open(json_file_path, "w", encoding="utf-8") as f:
            f.write(json.dumps(written, indent=2, sort_keys=True) + "\n")


def _save_pretrained(self: Any, save_directory: Any, push_to_hub: bool = False, **kwargs: Any) -> None:
    type(self).lapheads_base.save_pretrained(self, save_directory, push_to_hub=push_to_hub, **kwargs)
    write_beside(str(save_directory), self)


def _upload_config(self: Any, working_dir: Any, repo_id: str, *args: Any, **kwargs: Any) -> Any:
    write_beside(str(working_dir), self, repo_id)
    return type(self).lapheads_base._upload_modified_files(self, working_dir, repo_id, *args, **kwargs)


def _rebuild(base: Any) -> Any:
    """Unpickle (or deep-copy) a config of :func:`saving_class`: its class is rebuilt from the base class."""
    config = base.__new__(base)
    object.__setattr__(config, "__class__", saving_class(base))
    return config


def _reduce_ex(self: Any, protocol: Any) -> Any:
    return (_rebuild, (type(self).lapheads_base,), dict(self.__dict__))


_SAVING_CLASSES: dict[type, type] = {}


def saving_class(base: type) -> type:
    """The class a config with Laplacian heads gets: ``base`` with the same name and module (transformers finds
    its model classes by that name), whose ``config.json`` is in the Laplacian checkpoint format and whose
    ``save_pretrained`` / ``push_to_hub`` also write the loader file and the model card."""
    base = getattr(base, "lapheads_base", None) or base
    cls = _SAVING_CLASSES.get(base)
    if cls is None:
        namespace = {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
            "lapheads_base": base,
            "to_json_file": _to_json_file,
            "save_pretrained": _save_pretrained,
            "_upload_modified_files": _upload_config,
            "__reduce_ex__": _reduce_ex,
        }
        cls = _SAVING_CLASSES[base] = type(base.__name__, (base,), namespace)
    return cls


def mark_config(
    config: PreTrainedConfig, needs_index: Optional[bool] = None, fused: Optional[str] = None
) -> PreTrainedConfig:
    """Make THIS config save as a checkpoint with Laplacian heads, or as a standard one.

    Sets (or, without Laplacian heads, removes) the plain attribute ``config.attn_implementation``, and
    gives a config with Laplacian heads in its tree the class of :func:`saving_class`; returns ``config``.

    Args:
        config: a transformers config (anything else is returned untouched).
        needs_index: whether plain loading cannot reproduce the model (the name then says to load
            it with :func:`lapheads.transformers.from_pretrained`); default: what the config's saved
            name says.
        fused: the fused name of the model (:func:`fused_implementation`); default: the saved one,
            else the config's own.
    """
    if not isinstance(config, PreTrainedConfig):  # a stand-in config (a test's namespace): nothing to save
        return config
    name = _saved_implementation(config, needs_index, fused)
    if name is None:
        config.__dict__.pop(SAVED_KEY, None)
    elif config.__dict__.get(SAVED_KEY) != name:
        setattr(config, SAVED_KEY, name)
    if _has_heads(config) and not hasattr(type(config), "lapheads_base"):
        object.__setattr__(config, "__class__", saving_class(type(config)))
    return config


def _upload_model(model: Any, working_dir: Any, repo_id: str, *args: Any, **kwargs: Any) -> Any:
    write_beside(str(working_dir), model.config, repo_id)
    return type(model)._upload_modified_files(model, working_dir, repo_id, *args, **kwargs)


def hook_push(model: Any) -> None:
    """Make ``model.push_to_hub`` (and ``save_pretrained(push_to_hub=True)``) upload the model card: transformers
    writes its own ``README.md`` after saving, and this puts the lapheads card back before the upload."""
    object.__setattr__(model, "_upload_modified_files", functools.partial(_upload_model, model))
