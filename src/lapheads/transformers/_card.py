"""The Hub model card (``README.md``) that a checkpoint with Laplacian heads is saved with."""

from __future__ import annotations

import os
import re
from typing import Any, Optional

from huggingface_hub import ModelCard, ModelCardData

from ..errors import ConfigError
from ..heads import LaplacianHeads
from ._configs import config_spec, config_tree, layer_selections
from ._format import LOADER_FILE, spec_has_heads
from ._names import INDEXED_ATTN_IMPLEMENTATION_SUFFIX, MODEL_TYPE_PREFIX

#: The line that says lapheads wrote a card, so a later save may write it again (a card without it is kept).
MARKER = "<!-- lapheads model card: each save rewrites it; delete this line to keep your own edits -->"
TAGS = ["lapheads", "laplacian-heads"]
# The card transformers' push_to_hub writes when the repository has none: replaced, like one of ours.
_TRANSFORMERS_DEFAULT = "This model card has been automatically generated."
CITATION = """@article{zhang2026laplacian,
  title   = {Laplacian Heads Improve Transformers by Smoothing Token Representations},
  author  = {Zhang, Yuchong and Papyan, Vardan},
  journal = {arXiv preprint arXiv:2602.09297},
  year    = {2026}
}"""
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _ranges(rows: list[tuple[int, str, int]]) -> list[tuple[str, str, int]]:
    """Consecutive layers with the same heads as one row: ``(layers, heads, count)``."""
    out: list[tuple[str, str, int]] = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i][1:] != rows[start][1:]:
            layers = str(start) if i - 1 == start else f"{start}-{i - 1}"
            out.append((layers, rows[start][1], rows[start][2]))
            start = i
    return out


def _stack_section(path: str, config: Any) -> str:
    spec = config_spec(config)
    name = f"`{path}`: " if path else ""
    lines = [f"{name}`laplacian_heads = {spec!r}`"]
    heads = LaplacianHeads(spec)
    if heads.learnable:
        start = heads.learn_init
        lines.append(
            f"\nLearnable mixing: every head computes `a_h V_self + b_h P V`, with its own `a_h`, `b_h` saved with the "
            f"weights (`lap_mix_a`, `lap_mix_b`); they started as `{start}` (standard `(0, 1)`, Laplacian `(1, -1)`)."
        )
        return "\n".join(lines)
    try:
        selections = layer_selections(config)
    except ConfigError:
        return "\n".join(lines)
    n_heads = len(selections[0].flags)
    coefs = {sel.coef for sel in selections if sel.count}
    if coefs - {(1.0, -1.0)}:
        lines.append(f"\nThe heads listed apply `a I + b P` with `(a, b)` = {', '.join(map(str, sorted(coefs)))}.")
    rows = [(i, ", ".join(str(h) for h in sel.indices) or "none", sel.count) for i, sel in enumerate(selections)]
    lines += [
        f"\n{len(selections)} layers of {n_heads} heads; heads numbered from 0:\n",
        "| layers | Laplacian heads | count |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {layers} | {h} | {count} |" for layers, h, count in _ranges(rows)]
    return "\n".join(lines)


def base_model(config: Any, repo_id: Optional[str]) -> Optional[str]:
    """The Hub id the model was loaded from, when it was one (and is not the repository written now)."""
    name = str(getattr(config, "_name_or_path", "") or "")
    if _HUB_ID.match(name) and not os.path.exists(name) and name != repo_id:
        return name
    return None


def _load_call(config: Any, where: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = (getattr(config, "architectures", None) or [None])[0]
    if arch is None or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type) == arch:
        return f'import lapheads.transformers as lt\n\nmodel = lt.from_pretrained("{where}")'
    return (
        f"import transformers\nimport lapheads.transformers as lt\n\n"
        f'model = lt.from_pretrained("{where}", model_class=transformers.{arch})'
    )


def card_text(config: Any, where: str, repo_id: Optional[str] = None, tags: Optional[list[str]] = None) -> str:
    """The model card of ``config`` (a config with Laplacian heads); ``where``: the path or hub id to load."""
    data = ModelCardData(
        library_name="transformers",
        tags=list(dict.fromkeys([*TAGS, *(tags or [])])),
        base_model=base_model(config, repo_id),
    )
    arch = ", ".join(getattr(config, "architectures", None) or [type(config).__name__.removesuffix("Config")])
    stacks = [(p, c) for p, c in config_tree(config) if spec_has_heads(config_spec(c))]
    plain_auto = all(
        not str(c.__dict__.get("attn_implementation", "")).endswith(INDEXED_ATTN_IMPLEMENTATION_SUFFIX)
        and not LaplacianHeads(config_spec(c)).learnable
        for _, c in stacks
    )
    sections = "\n\n".join(_stack_section(p, c) for p, c in stacks)
    auto = (
        "After `import lapheads.transformers`, transformers' own `AutoModelForCausalLM.from_pretrained`, "
        "`pipeline(...)` and lm-eval's `HFLM` load it too."
        if plain_auto
        else "transformers' own loaders do not build the layer index (or read the learned mixing) it needs, "
        "so load it with `lt.from_pretrained`."
    )
    body = f"""{MARKER}

# {arch} with Laplacian heads

A Laplacian head outputs `V - softmax(QK^T) V` instead of `softmax(QK^T) V` (Zhang & Papyan, 2026). This
`{arch}` checkpoint (model type `{config.model_type}`) has Laplacian heads in the layers below; every other
head is standard attention.

## Heads per layer

{sections}

## How to load it

```bash
pip install lapheads
```

```python
{_load_call(config, where)}
```

{auto} transformers alone refuses this checkpoint rather than run it as standard attention: `config.json`
has the model type `{MODEL_TYPE_PREFIX}{config.model_type}`, which it does not know, and with
`trust_remote_code=True` it runs `{LOADER_FILE}`, which imports lapheads.

## Citation

```bibtex
{CITATION}
```
"""
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


def _replaceable(text: str) -> bool:
    return MARKER in text or _TRANSFORMERS_DEFAULT in text


def write_card(directory: str, config: Any, where: Optional[str] = None, repo_id: Optional[str] = None) -> bool:
    """Write ``README.md`` in ``directory`` unless it holds a card that lapheads (or transformers' default) did
    not write; the tags of the card it replaces are kept. Returns whether it wrote."""
    path = os.path.join(directory, "README.md")
    tags: list[str] = []
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            old = f.read()
        if not _replaceable(old):
            return False
        try:
            tags = list(getattr(ModelCard(old, ignore_metadata_errors=True).data, "tags", None) or [])
        except ValueError:  # a metadata block that is not a mapping
            tags = []
    text = card_text(config, where or repo_id or directory, repo_id=repo_id, tags=tags)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return True


def remove_card(directory: str) -> None:
    """Remove a card lapheads wrote (the model saved there now has no Laplacian heads)."""
    path = os.path.join(directory, "README.md")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            if MARKER in f.read():
                os.remove(path)
