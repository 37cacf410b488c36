"""The base of every streaming accumulator: input checks, float64 sums with a shift against
cancellation, merge, all-reduce and resume (design: docs/design/geometry.md)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..errors import ConfigError, DataError

F64 = torch.float64

__all__ = ["F64", "Accumulator", "broadcast_from_lowest_rank", "check_inputs", "dense_ids", "or_error", "segment_sum"]


def check_inputs(
    x: torch.Tensor,
    sequence_ids: Optional[torch.Tensor] = None,
    labels: Optional[torch.Tensor] = None,
    *,
    name: str = "x",
    label_name: str = "labels",
    dim: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One batch checked and converted: ``x`` (N, D) finite floats (numpy accepted), ``sequence_ids``
    and ``labels`` (N,) integers as int64 (label ``-1`` = no class); ``name`` and ``label_name``
    name ``x`` and ``labels`` in error messages; ``dim``, when given, is the width ``x`` must have."""
    x = torch.as_tensor(x)
    if x.dim() != 2:
        raise DataError(f"{name} must be a 2-D (tokens, dim) array, got shape {tuple(x.shape)}")
    if not (x.is_floating_point()):
        raise DataError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    if x.shape[0] == 0:
        raise DataError(f"{name} is empty (0 tokens)")
    # one reduction (cheap) instead of an elementwise isfinite; only a non-finite sum looks closer
    if not bool(torch.isfinite(x.sum(dtype=torch.float64))) and not bool(torch.isfinite(x).all()):
        bad = torch.nonzero(~torch.isfinite(x))[0]
        raise DataError(
            f"{name} contains NaN or Inf (first at token {int(bad[0])}, dim {int(bad[1])}); "
            "geometry needs finite features"
        )

    def _ids(t: Any, what: str) -> torch.Tensor:
        t = torch.as_tensor(t)
        if t.dim() != 1 or t.shape[0] != x.shape[0]:
            raise DataError(
                f"{what} must have shape ({x.shape[0]},) to match {name} {tuple(x.shape)}, got {tuple(t.shape)}"
            )
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise DataError(f"{what} must be integers, got dtype {t.dtype}")
        return t.to(device=x.device, dtype=torch.int64)

    sid = _ids(sequence_ids, "sequence_ids") if sequence_ids is not None else None
    lab = _ids(labels, label_name) if labels is not None else None
    if lab is not None and lab.numel() and int(lab.min()) < -1:
        raise DataError(f"{label_name} must be >= 0 (or -1 for 'no class'), got {int(lab.min())}")
    if sid is not None and int(sid.min()) < 0:
        raise DataError(f"sequence_ids must be >= 0, got {int(sid.min())}")
    if dim is not None and x.shape[1] != dim:
        raise DataError(f"x has dimension {x.shape[1]}, this accumulator expects {dim}")
    return x, sid, lab


def or_error(compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A section's numbers, or ``{"error": message}`` when the data cannot give them (a :class:`DataError`)."""
    try:
        return compute()
    except DataError as e:
        return {"error": str(e)}


def segment_sum(src: torch.Tensor, sid: torch.Tensor, S: int, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-segment float64 sums (S, D) of the rows of ``src`` (optionally weighted)."""
    if S <= 64:
        A = torch.zeros(S, src.shape[0], dtype=F64, device=src.device)
        A[sid, torch.arange(src.shape[0], device=src.device)] = 1.0 if weights is None else weights
        return A @ src.to(F64) if src.dtype != F64 else A @ src
    s = src.to(F64) if weights is None else src * weights[:, None].to(F64)
    return torch.zeros(S, src.shape[1], dtype=F64, device=src.device).index_add_(0, sid, s)


def dense_ids(ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary non-negative ids to 0..S-1 (in sorted order); returns (dense ids, S)."""
    uniq, inv = torch.unique(ids, return_inverse=True)
    return inv, int(uniq.numel())


def broadcast_from_lowest_rank(
    value: Optional[torch.Tensor], shape: tuple[int, ...], device: torch.device, group: Any = None
) -> Optional[torch.Tensor]:
    """The float64 ``value`` of the lowest rank that has one (None if no rank has), on every rank
    (every rank must call it): the shared reference point of sums that are to be added."""
    none = 1 << 30
    rank = torch.tensor([dist.get_rank() if value is not None else none], device=device)
    dist.all_reduce(rank, op=dist.ReduceOp.MIN, group=group)
    src = int(rank.item())
    if src >= none:
        return None
    out = (value if value is not None else torch.zeros(shape, dtype=F64, device=device)).clone()
    dist.broadcast(out, src=src, group=group)
    return out


class Accumulator:
    """Base class: a bag of float64 state tensors that are summed to merge. Subclasses list them in
    ``_sum_names`` (other state in ``_extra_names``), their settings (checked on merge / load) in
    ``_config()``, and move shifted sums in ``_move_sums``."""

    _sum_names: tuple[str, ...] = ()
    _extra_names: tuple[str, ...] = ()  # state that is not a sum: None until set, then kept on merge

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def _config(self) -> dict[str, Any]:
        return {}

    def _children(self) -> dict[str, "Accumulator"]:
        return {}

    shift: Optional[torch.Tensor] = None

    def _reshift(self, new_shift: torch.Tensor) -> None:
        """Re-express the shifted sums in ``new_shift``: x - b = (x - a) + d with d = a - b."""
        new_shift = new_shift.to(self.device, F64).clone()
        if self.shift is not None:
            self._move_sums(self.shift - new_shift)
        self.shift = new_shift

    def _move_sums(self, d: torch.Tensor) -> None:
        """Add ``d`` to every shifted value summed (overridden by accumulators with a shift)."""

    def _shift_shape(self) -> Optional[tuple[int, ...]]:
        """The shape of the shift, None for an accumulator without one."""
        return (self.dim,) if hasattr(self, "dim") else None

    def _grow(self, n: int) -> None:
        """Make room for ``n`` classes (class-table accumulators override this)."""

    def _n_classes_capacity(self) -> int:
        return 0

    def merge(self, other: "Accumulator") -> "Accumulator":
        """Add the sums of ``other`` (same type and settings) into ``self``; returns ``self``."""
        if type(other) is not type(self):
            raise ConfigError(f"cannot merge {type(other).__name__} into {type(self).__name__}")
        if other._config() != self._config():
            raise ConfigError(
                f"cannot merge accumulators with different settings: {self._config()} vs {other._config()}"
            )
        if self.shift is None and other.shift is not None:
            self._reshift(other.shift.clone())
        if other.shift is not None and not torch.equal(self.shift, other.shift):
            other = other.copy()
            other._reshift(self.shift)
        cap = max(self._n_classes_capacity(), other._n_classes_capacity())
        self._grow(cap)
        if other._n_classes_capacity() < cap:
            other = other.copy() if other is not self else other
            other._grow(cap)
        for n in self._sum_names:
            a, b = getattr(self, n), getattr(other, n)
            setattr(self, n, a + b.to(a.device))
        for n in self._extra_names:
            if getattr(self, n) is None:
                setattr(self, n, getattr(other, n))
        for k, ch in self._children().items():
            ch.merge(other._children()[k])
        return self

    def copy(self) -> "Accumulator":
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        for n in self._sum_names:
            setattr(new, n, getattr(self, n).clone())
        if self.shift is not None:
            new.shift = self.shift.clone()
        for k, ch in self._children().items():
            setattr(new, k, ch.copy())
        return new

    def all_reduce(self, group: Any = None) -> "Accumulator":
        """Sum the state over all processes of ``torch.distributed`` (no-op when not initialised;
        every rank must call it): exactly the state of one accumulator fed with every rank's batches."""
        if not (dist.is_available() and dist.is_initialized()):
            return self
        cap = torch.tensor([self._n_classes_capacity()], dtype=torch.int64, device=self.device)
        dist.all_reduce(cap, op=dist.ReduceOp.MAX, group=group)
        self._grow(int(cap.item()))
        shape = self._shift_shape()
        if shape is not None:  # the shift of the lowest rank that has seen data
            sh = broadcast_from_lowest_rank(self.shift, shape, self.device, group)
            if sh is not None and (self.shift is None or not torch.equal(sh, self.shift)):
                self._reshift(sh)
        for n in self._sum_names:
            dist.all_reduce(getattr(self, n), group=group)
        for ch in self._children().values():
            ch.all_reduce(group)
        return self

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: config, sums, shift and children (tensors on CPU)."""
        return {
            "type": type(self).__name__,
            "config": self._config(),
            "shift": None if self.shift is None else self.shift.cpu().clone(),
            **{n: getattr(self, n).detach().cpu().clone() for n in self._sum_names},
            **{n: getattr(self, n) for n in self._extra_names},
            "children": {k: ch.state_dict() for k, ch in self._children().items()},
        }

    def load_state_dict(self, sd: dict[str, Any]) -> "Accumulator":
        """Restore from :meth:`state_dict`; the settings must match the saved ones."""
        if sd.get("type") != type(self).__name__:
            raise ConfigError(f"state is for {sd.get('type')!r}, not {type(self).__name__}")
        if sd.get("config") != self._config():
            raise ConfigError(f"saved accumulator settings {sd.get('config')} differ from these {self._config()}")
        self.shift = None if sd["shift"] is None else sd["shift"].to(self.device, F64)
        for n in self._sum_names:
            setattr(self, n, sd[n].to(self.device).clone())
        for n in self._extra_names:
            setattr(self, n, sd.get(n))
        for k, ch in self._children().items():
            ch.load_state_dict(sd["children"][k])
        return self

    def _prep(self, x: torch.Tensor) -> torch.Tensor:
        """float64 copy of ``x`` minus the shift (set from the first batch's mean)."""
        x = x.to(self.device)
        if self.shift is None:
            self.shift = x.mean(0, dtype=F64)
        return x - self.shift  # promotes to float64 in the same pass
