"""``torch.nn.MultiheadAttention`` with Laplacian heads: :class:`MultiheadAttention`, a drop-in with the
same constructor, ``forward`` and ``state_dict`` keys, plus ``laplacian_heads`` (more: docs/integrations.md).

Masks follow torch (a boolean ``True`` means NOT allowed). Inside ``TransformerEncoderLayer`` the
heads stay active in every mode thanks to a no-op forward pre-hook: do not clear the module's pre-hooks.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import ConfigError
from .heads import LayerHeads, layer_operator, learnable_spec, set_layer_heads
from .ops import causal_lower_right_mask, laplacian_attention, laplacian_attention_reference

__all__ = ["MultiheadAttention"]


def _keep_torch_off_its_fast_path(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
    """No-op forward pre-hook: with it, ``TransformerEncoderLayer`` skips its fused inference kernel,
    which would bypass :meth:`MultiheadAttention.forward` and drop the Laplacian heads."""
    return None


def _additive(mask: Optional[Tensor], name: str, dtype: torch.dtype) -> Optional[Tensor]:
    """torch MHA mask (bool: True = masked out; float: added) -> additive float mask."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise ConfigError(f"{name} must be a bool or float tensor, got dtype {mask.dtype}")
    return mask.to(dtype)


class MultiheadAttention(torch.nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` whose selected heads are Laplacian heads.

    The arguments before ``laplacian_heads`` are torch's (``dropout`` acts on P only).

    Args:
        laplacian_heads: which heads are Laplacian: anything :meth:`lapheads.LayerHeads.of` accepts
            (int k = trailing k heads, ``"all"``, head indices, a boolean mask, ...), resolved once
            into ``laplacian_selection``. Default ``"none"``: exactly torch's module. ``"learn"``,
            ``"learn:laplacian"``, ``"learn:<k>"``: learnable mixing ``a_h I + b_h P`` (parameters
            ``lap_mix_a`` / ``lap_mix_b``; a fixed selection keeps exactly torch's parameters).
    """

    laplacian_selection: LayerHeads

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        batch_first: bool = False,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
        laplacian_heads: Any = "none",
    ) -> None:
        # Validate the head selection before allocating parameters.
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ConfigError(f"num_heads={num_heads!r} must be a positive int")
        learn = learnable_spec(laplacian_heads)
        selection = LayerHeads.of(laplacian_heads, num_heads) if learn is None else learn
        if learn is not None:
            learn.init_selection(1, num_heads)  # a learnable k > num_heads is refused here too
        super().__init__(
            embed_dim,
            num_heads,
            dropout=dropout,
            bias=bias,
            add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn,
            kdim=kdim,
            vdim=vdim,
            batch_first=batch_first,
            device=device,
            dtype=dtype,
        )
        self.laplacian_heads = learn.spec if learn is not None else laplacian_heads
        set_layer_heads(self, selection, num_heads)  # laplacian_selection, laplacian_learnable, lap_mix_a / _b
        # A module-level function, so deepcopy and pickling keep it.
        self.register_forward_pre_hook(_keep_torch_off_its_fast_path)

    @classmethod
    def from_torch(cls, module: torch.nn.MultiheadAttention, laplacian_heads: Any = "none") -> "MultiheadAttention":
        """A copy of a torch ``MultiheadAttention`` (same options and weights) with Laplacian heads."""
        w = module.out_proj.weight
        new = cls(
            module.embed_dim,
            module.num_heads,
            dropout=module.dropout,
            bias=module.out_proj.bias is not None,
            add_bias_kv=module.bias_k is not None,
            add_zero_attn=module.add_zero_attn,
            kdim=module.kdim,
            vdim=module.vdim,
            batch_first=module.batch_first,
            device=w.device,
            dtype=w.dtype,
            laplacian_heads=laplacian_heads,
        )
        missing, unexpected = new.load_state_dict(module.state_dict(), strict=False)
        if unexpected or any(not k.startswith("lap_mix_") for k in missing):
            raise ConfigError(f"from_torch: state_dict mismatch (missing {missing}, unexpected {unexpected})")
        new.train(module.training)
        return new

    def extra_repr(self) -> str:
        n = self.laplacian_selection.count
        what = "learnable a I + b P" if self.laplacian_learnable else f"{n} of {self.num_heads}"
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}, "
            f"laplacian_heads={self.laplacian_heads!r} ({what})"
        )

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Input projections of batch-first (N, L, E) inputs, as torch computes them."""
        e = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.split(e)  # type: ignore[no-untyped-call]
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            if query is key and key is value:
                # One GEMM for self-attention, as torch does (same rounding as torch's path).
                q, k, v = F.linear(query, w, b).chunk(3, dim=-1)
                return q, k, v
            wq, wk, wv = w.split(e)  # type: ignore[no-untyped-call]
            if key is value:
                kv = F.linear(key, w[e:], None if b is None else b[e:]).chunk(2, dim=-1)
                return F.linear(query, wq, bq), kv[0], kv[1]
            return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)
        return (
            F.linear(query, self.q_proj_weight, bq),
            F.linear(key, self.k_proj_weight, bk),
            F.linear(value, self.v_proj_weight, bv),
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Same arguments, shapes and returns as ``torch.nn.MultiheadAttention.forward``; ``attn_weights``
        (``need_weights=True``, the slower eager path) is the operator each head applied to V, and
        ``is_causal`` builds the causal mask when ``attn_mask`` is None."""
        # One function on purpose: it mirrors torch.nn.MultiheadAttention.forward argument by argument (masks,
        # need_weights, batch_first, kdim/vdim), so the two can be read side by side.
        if query.is_nested or key.is_nested or value.is_nested:
            return self._forward_nested(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        batched = query.dim() == 3
        given = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ConfigError(
                f"query, key, value must all be 3-D (batched) or 2-D (unbatched); got shapes "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        same_kv, self_attn = key is value, (query is key and key is value)
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        # Restore identity after reshaping so the projection can share GEMMs like torch does.
        if self_attn:
            key = value = query
        elif same_kv:
            value = key
        n, tq, e = query.shape
        s = key.shape[1]
        h, hd = self.num_heads, self.head_dim
        if (e, key.shape[-1], value.shape[-1]) != (self.embed_dim, self.kdim, self.vdim):
            raise ConfigError(
                f"feature sizes of {given} do not match embed_dim={self.embed_dim}, kdim={self.kdim}, vdim={self.vdim}"
            )
        if key.shape[:2] != value.shape[:2] or key.shape[0] != n:
            raise ConfigError(
                f"{given}: key and value must have the same batch and sequence sizes, and the same batch "
                f"size as query (batch_first={self.batch_first})"
            )
        lap = layer_operator(self)
        if lap.identity and tq > s:
            raise ConfigError(
                f"Laplacian heads need every query to have its own position among the keys, but the "
                f"query has {tq} positions and the key only {s}"
            )

        q, k, v = self._project(query, key, value)
        # The mask takes the dtype of the projected queries (bf16 under autocast), as SDPA requires.
        mask = self._merged_mask(key_padding_mask, attn_mask, is_causal, n, tq, s, q.dtype, q.device)
        q = q.view(n, tq, h, hd).transpose(1, 2)
        k = k.view(n, s, h, hd).transpose(1, 2)
        v = v.view(n, s, h, hd).transpose(1, 2)
        extra = 0
        if self.bias_k is not None and self.bias_v is not None:
            # In front (the order of keys does not matter): the last Tq positions stay the real tokens.
            bk = self.bias_k.view(1, h, 1, hd).expand(n, h, 1, hd).to(k.dtype)
            bv = self.bias_v.view(1, h, 1, hd).expand(n, h, 1, hd).to(v.dtype)
            k, v = torch.cat([bk, k], dim=2), torch.cat([bv, v], dim=2)
            extra += 1
        if self.add_zero_attn:
            k, v = F.pad(k, (0, 0, 1, 0)), F.pad(v, (0, 0, 1, 0))  # a zero key and value in front
            extra += 1
        if mask is not None and extra:
            mask = F.pad(mask, (extra, 0))  # extra keys are visible to every query, as in torch

        dropout_p = self.dropout if self.training else 0.0
        weights: Optional[Tensor] = None
        if need_weights:
            out, op = laplacian_attention_reference(q, k, v, laplacian_heads=lap, attn_mask=mask, dropout_p=dropout_p)
            if extra:
                op = torch.cat([op[..., extra:], op[..., :extra].flip(-1)], dim=-1)  # torch's column order
            weights = op.mean(dim=1) if average_attn_weights else op
            if not batched:
                weights = weights.squeeze(0)
        else:
            out = laplacian_attention(q, k, v, laplacian_heads=lap, attn_mask=mask, dropout_p=dropout_p)

        out = out.transpose(1, 2).reshape(n, tq, e)
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _forward_nested(
        self,
        x: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor],
        need_weights: bool,
        attn_mask: Optional[Tensor],
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Self-attention on a nested ``(N, j, E)`` tensor: pad, attend with a padding mask, re-nest."""
        if not (x is key and key is value):
            raise ConfigError("nested-tensor input is supported for self-attention only (query is key is value)")
        if not self.batch_first:
            raise ConfigError("nested-tensor input needs batch_first=True (a nested tensor is (N, j, E))")
        if key_padding_mask is not None or attn_mask is not None:
            raise ConfigError(
                "nested-tensor input takes no attn_mask or key_padding_mask: the nested "
                "tensor's own lengths are the padding (as in torch's fused path)"
            )
        lengths = [t.shape[0] for t in x.unbind()]
        padded = x.to_padded_tensor(0.0)
        pad = (
            torch.arange(padded.shape[1], device=padded.device)[None, :]
            >= torch.tensor(lengths, device=padded.device)[:, None]
        )
        # forward's own argument order: key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
        out, weights = self.forward(padded, padded, padded, pad, need_weights, None, average_attn_weights, is_causal)
        nested = torch.nested.as_nested_tensor([o[:n] for o, n in zip(out.unbind(), lengths)], layout=x.layout)
        return nested, weights  # weights (if any) stay padded: (N, [H,] L_max, L_max)

    def _merged_mask(
        self,
        key_padding_mask: Optional[Tensor],
        attn_mask: Optional[Tensor],
        is_causal: bool,
        n: int,
        tq: int,
        s: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Optional[Tensor]:
        """One additive mask broadcastable to (N, H, Tq, S), or None (torch semantics, see docstring)."""
        h = self.num_heads
        am = _additive(attn_mask, "attn_mask", dtype)
        if am is not None:
            if am.dim() == 2:
                if tuple(am.shape) != (tq, s):
                    raise ConfigError(f"2-D attn_mask has shape {tuple(am.shape)}, expected (L, S) = {(tq, s)}")
                am = am.view(1, 1, tq, s)
            elif am.dim() == 3:
                if tuple(am.shape) != (n * h, tq, s):
                    raise ConfigError(
                        f"3-D attn_mask has shape {tuple(am.shape)}, expected (N * num_heads, L, S) = {(n * h, tq, s)}"
                    )
                am = am.view(n, h, tq, s)
            else:
                raise ConfigError(f"attn_mask must be 2-D or 3-D, got shape {tuple(am.shape)}")
        elif is_causal:
            causal = causal_lower_right_mask(tq, s, device)
            am = torch.zeros((tq, s), dtype=dtype, device=device).masked_fill(~causal, float("-inf")).view(1, 1, tq, s)
        kpm = _additive(key_padding_mask, "key_padding_mask", dtype)
        if kpm is not None:
            if tuple(kpm.shape) != (n, s):
                raise ConfigError(
                    f"key_padding_mask has shape {tuple(kpm.shape)}, expected (N, S) = {(n, s)} "
                    f"((S,) = ({s},) for unbatched input)"
                )
            kpm = kpm.view(n, 1, 1, s)
            am = kpm if am is None else am + kpm
        return am
