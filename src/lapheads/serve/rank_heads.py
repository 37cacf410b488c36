"""The Laplacian heads of one tensor-parallel rank, applied to a serving engine's attention output.

A serving engine computes ``P V`` for the tokens of a step (prefill chunks and decoded tokens of every
sequence, packed into one row of ``T`` tokens) and keeps the KV cache to itself. A Laplacian head needs
only one more thing: the value of each query's own token, which is the ``value`` the engine's attention
layer was handed for those ``T`` tokens. So a head's output is ``a V + b PV`` on top of the engine's
``PV``, with the cache untouched.

Layouts (vLLM's Transformers backend, which keeps transformers' own tensors):

- ``out``: ``(T, H_rank * D)``, the engine's attention output, head-major in the last dimension;
- ``value``: ``(1, H_kv_rank, T, D)``, the values of the same ``T`` tokens, as the model's attention
  module computed them.

Tensor parallelism gives rank ``r`` of ``tp`` the query heads ``[r * H / tp, (r + 1) * H / tp)`` and
the KV heads they read (``H_kv / tp`` of them, or one replicated KV head when ``tp > H_kv``), so a
rank's query head ``j`` reads its local KV head ``j // (H_rank / H_kv_rank)``, as grouped-query
attention does on the whole model.
"""

from __future__ import annotations

from typing import Union

import torch

from ..errors import ConfigError
from ..heads import HeadMix, LayerHeads

RankOperator = Union[LayerHeads, HeadMix]


def check_tensor_parallel(n_heads: int, n_kv_heads: int, tp: int) -> None:
    """Refuse a tensor-parallel size that does not give each rank whole query heads and the KV heads they read.

    Raises:
        ConfigError: ``n_heads`` is not a multiple of ``tp``, or ``tp`` neither divides nor is a
            multiple of ``n_kv_heads`` (so a rank's query heads would read another rank's values).
    """
    if tp < 1 or n_heads < 1 or n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ConfigError(
            f"tensor_parallel_size={tp} with {n_heads} query heads and {n_kv_heads} KV heads: "
            "the sizes must be positive and the query heads a multiple of the KV heads"
        )
    if n_heads % tp:
        raise ConfigError(
            f"tensor_parallel_size={tp} splits the {n_heads} query heads unevenly, so the Laplacian head "
            f"selection cannot be sliced per rank: use a tensor_parallel_size that divides {n_heads}"
        )
    if n_kv_heads % tp and tp % n_kv_heads:
        raise ConfigError(
            f"tensor_parallel_size={tp} neither divides nor is a multiple of the {n_kv_heads} KV heads, so a "
            "rank's query heads would need values held by another rank (the identity term of a Laplacian "
            f"head): use a tensor_parallel_size that divides {n_kv_heads} or is a multiple of it"
        )


def rank_slice(n_heads: int, tp: int, rank: int) -> slice:
    """The query heads rank ``rank`` of ``tp`` holds: ``[rank * n_heads / tp, (rank + 1) * n_heads / tp)``."""
    if not 0 <= rank < tp:
        raise ConfigError(f"tensor-parallel rank {rank} is outside 0..{tp - 1}")
    per = n_heads // tp
    return slice(rank * per, (rank + 1) * per)


def rank_selection(selection: LayerHeads, n_kv_heads: int, tp: int, rank: int) -> LayerHeads:
    """The part of one layer's head selection (all ``H`` query heads) that rank ``rank`` of ``tp`` serves.

    Raises:
        ConfigError: the split is refused by :func:`check_tensor_parallel`.
    """
    check_tensor_parallel(selection.n_heads, n_kv_heads, tp)
    return LayerHeads(selection.flags[rank_slice(selection.n_heads, tp, rank)], selection.coef)


def apply_rank_heads(out: torch.Tensor, value: torch.Tensor, heads: RankOperator) -> torch.Tensor:
    """One rank's heads on the engine's attention output: ``a_h V + b_h PV`` per head (standard heads keep ``PV``).

    Args:
        out: ``(T, H_rank * D)``, the engine's ``PV`` for the step's tokens.
        value: ``(1, H_kv_rank, T, D)``, those tokens' values (before the KV cache, which is not read).
        heads: the rank's fixed selection (:func:`rank_selection`) or its slice of the learnable mixing.

    Returns:
        ``(T, H_rank * D)``; ``out`` itself when no head of the rank is Laplacian.

    Raises:
        ConfigError: the shapes disagree with each other or with the number of heads in ``heads``.
    """
    if value.dim() != 4 or value.shape[0] != 1 or out.dim() != 2:
        raise ConfigError(
            f"the serving engine's attention handed value {tuple(value.shape)} and output {tuple(out.shape)}; "
            "expected (1, H_kv, T, D) and (T, H * D)"
        )
    n_kv, t, d = value.shape[1], value.shape[2], value.shape[3]
    n_heads = out.shape[1] // d
    n_sel = heads.n_heads if isinstance(heads, LayerHeads) else heads.a.shape[0]
    if out.shape[0] != t or out.shape[1] != n_heads * d or n_heads % n_kv or n_sel != n_heads:
        raise ConfigError(
            f"the serving engine's attention output {tuple(out.shape)} does not fit value {tuple(value.shape)} "
            f"and a head operator of {n_sel} heads on this rank"
        )
    if isinstance(heads, LayerHeads) and not heads.any:
        return out
    pv = out.view(t, n_heads, d).transpose(0, 1)  # (H, T, D)
    mixed = heads.apply(pv, value[0])  # the head operator of lapheads.heads, GQA as SDPA
    return mixed.transpose(0, 1).reshape(t, n_heads * d)
