"""``lapheads sample``: text from a trained language-model run.

``lapheads sample --run runs/lm_tiny --prompt "The list type" --max-new-tokens 64 --temperature 0.8 --top-k 50``
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import ConfigError
from .tokenizer import render_chat, stop_token_ids

__all__ = ["generate_text"]


@torch.no_grad()
def generate_text(
    model: Any,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    num_samples: int = 1,
    chat: bool = False,
    seed: int = 0,
) -> list[str]:
    """Continue ``prompt`` ``num_samples`` times.

    Args:
        model: a transformers causal LM (e.g. from :func:`lapheads.recipes.lm.load_model`).
        tokenizer: its tokenizer (made by ``lapheads tokenizer train``).
        prompt: the text to continue, or the user message with ``chat``.
        max_new_tokens: tokens to generate at most.
        temperature: 0 = greedy; > 0 = sampling.
        top_k: keep the k most likely tokens when sampling (None = all).
        num_samples: independent continuations (greedy ones are identical).
        chat: render as a user turn + ``<|assistant_start|>``.
        seed: sampling seed.

    Returns:
        The generated texts (special tokens removed).

    Raises:
        ConfigError: a negative temperature, a non-positive token count or top-k.
    """
    if not temperature >= 0 or max_new_tokens < 1 or num_samples < 1 or (top_k is not None and top_k < 1):
        raise ConfigError(
            f"need temperature >= 0 (got {temperature}), max_new_tokens >= 1 (got {max_new_tokens}), "
            f"num_samples >= 1 (got {num_samples}) and top_k >= 1 or unset (got {top_k})"
        )
    dev = next(model.parameters()).device
    if chat:
        ids, _ = render_chat(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
    else:
        ids = tokenizer(prompt)["input_ids"]
    x = torch.tensor([ids] * num_samples, dtype=torch.long, device=dev)
    kw: dict[str, Any] = {
        "do_sample": temperature > 0,
        "max_new_tokens": max_new_tokens,
        "eos_token_id": stop_token_ids(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
    }
    if temperature > 0:
        kw.update(temperature=temperature, top_k=top_k if top_k is not None else 0)
    torch.manual_seed(seed)
    model.eval()
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)
    return [tokenizer.decode(row[x.shape[1] :], skip_special_tokens=True) for row in out]
