"""FSDP2 for the engine (``train.parallel: fsdp``): sharding, Muon on shards, sharded checkpoints.
Design notes: docs/design/engine.md (Multi-GPU)."""

from __future__ import annotations

import contextlib
import copy
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError, ConfigError
from . import dist as D

# torch.distributed's FSDP, DTensor and DCP modules take ~1 s to import: the functions import them when called.
DCP_DIR = "dcp"  # sub-directory of a checkpoint holding the DCP files (model + optimizer shards)

T = TypeVar("T")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers model (classes in ``_no_split_modules``, looked up on every
    sub-module, so wrappers such as PEFT's work), in order; a :class:`ConfigError` when there are none."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ConfigError(
            f"train.parallel=fsdp: found no transformer blocks to shard in {type(model).__name__} "
            f"(no module of the classes {sorted(names) or 'in _no_split_modules'})"
        )
    return blocks


def shard_model(
    model: nn.Module, blocks: Sequence[nn.Module], device: torch.device, *, bf16: bool, world_size: Optional[int] = None
) -> None:
    """Apply ``fully_shard`` to every block of ``blocks``, then to the root (in place), over ``world_size``
    processes (default: the group's); ``bf16``: bf16 compute and all-gather, fp32 gradient reduction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = world_size or dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    for b in blocks:
        fully_shard(b, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward (transformers' switch, non-reentrant); ConfigError without one."""
    # transformers 5.x renamed the switch; the old name still works there but warns (FutureWarning)
    fn, kwargs = getattr(model, "activation_checkpointing_enable", None), "activation_checkpointing_kwargs"
    if fn is None:
        fn, kwargs = getattr(model, "gradient_checkpointing_enable", None), "gradient_checkpointing_kwargs"
    if fn is None or not getattr(model, "supports_gradient_checkpointing", True):
        raise ConfigError(
            f"train.activation_checkpointing: {type(model).__name__} does not support it "
            "(it needs a transformers model)"
        )
    fn(**{kwargs: {"use_reentrant": False}})


def _is_dtensor(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


class ShardedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` that orthogonalises the full matrix of a sharded (DTensor) parameter; same arguments."""

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        from torch.distributed.tensor import DTensor, distribute_tensor
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz  # private; torch versions with Muon

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.ndim != 2:
                    raise ValueError("Muon: parameter gradients must be 2D matrices")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                sharded = isinstance(update, DTensor)
                full = update.full_tensor() if sharded else update
                ortho = _zeropower_via_newtonschulz(full, group["ns_coefficients"], group["ns_steps"], group["eps"])
                if sharded:  # every rank holds the same full matrix: keep the local rows, no communication
                    ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
                p.mul_(1 - lr * wd)
                p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def muon_class(params: Iterable[torch.Tensor]) -> type[torch.optim.Muon]:
    """:class:`ShardedMuon` when any parameter is a DTensor shard, else ``torch.optim.Muon``."""
    return ShardedMuon if any(_is_dtensor(p) for p in params) else torch.optim.Muon


def plain_norm(norm: torch.Tensor) -> torch.Tensor:
    """The full value of a gradient norm that ``clip_grad_norm_`` returned as a DTensor."""
    return cast(Any, norm).full_tensor() if _is_dtensor(norm) else norm


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with parameters on the meta device (buffers real), made before sharding."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo)


def materialize(skeleton: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """Load a full CPU state dict into a :func:`meta_copy` (``assign``: no copy), ties restored."""
    skeleton.load_state_dict(state, strict=False, assign=True)
    tie = getattr(skeleton, "tie_weights", None)
    if callable(tie):
        tie()
    left = [n for n, p in skeleton.named_parameters() if p.is_meta]
    if left:
        raise CheckpointError(f"the gathered state dict misses {', '.join(left[:5])}")
    return skeleton.to("cpu")


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on rank 0's CPU (other ranks get ``{}``); a collective call."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state: Any = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, torch.Tensor], state)


@contextlib.contextmanager
def _quiet_single_process() -> Any:
    """DCP warns that it assumes one process when no group exists; that is what one process wants."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_sharded(path: Path, model: nn.Module, optims: Sequence[torch.optim.Optimizer]) -> None:
    """Every rank writes its shards of model and optimizer state into ``path/dcp`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, list(optims))
    with _quiet_single_process():
        dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(str(Path(path) / DCP_DIR)))


def load_sharded(path: Path, model: nn.Module, optims: Sequence[torch.optim.Optimizer]) -> None:
    """Load ``path/dcp`` into the (sharded or plain) model and optimizers, re-sharding as needed.

    Raises:
        CheckpointError: the checkpoint does not fit this model or these optimizers.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, list(optims))
    state = {"model": msd, "optim": osd}
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(Path(path) / DCP_DIR)))
    except Exception as e:  # DCP raises CheckpointException / RuntimeError with per-rank tracebacks
        msg = " ".join(str(e).split())
        raise CheckpointError(
            f"{path}: the sharded checkpoint does not fit this model and its optimizers ({msg[:300]})"
        ) from None
    set_state_dict(model, list(optims), model_state_dict=state["model"], optim_state_dict=state["optim"])  # type: ignore[arg-type]


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether the checkpoint directory holds DCP shards (written with ``parallel: fsdp``)."""
    return (Path(path) / DCP_DIR / ".metadata").is_file()


def consolidate(path: Path) -> dict[str, Any]:
    """``{"model": {name: full tensor}, "optim": ...}`` of a sharded checkpoint, in one process (no group needed)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise CheckpointError(f"{path} holds no sharded (DCP) checkpoint")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "full.pt"
        with _quiet_single_process():
            dcp_to_torch_save(str(path / DCP_DIR), str(out))
        return torch.load(out, map_location="cpu", weights_only=True)


def lockstep(
    batches: Iterable[T], fallback: Callable[[], T], device: torch.device, sharded: bool
) -> Iterator[tuple[T, bool]]:
    """``(batch, real)`` pairs, the same number on every rank when sharded (``fallback()`` with ``real=False``)."""
    if not sharded or not D.initialized():
        yield from ((b, True) for b in batches)
        return
    items = list(batches)
    # the count is agreed before the first forward: all_max is itself a collective, and a rank that
    # reached it while another still ran a sharded forward would pair it with that forward's all-gather
    most = D.all_max(len(items), device)
    for b in items:
        yield b, True
    for _ in range(most - len(items)):
        yield fallback(), False
