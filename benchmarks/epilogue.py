"""What the Laplacian heads add to one attention layer, counted op by op on the CPU (deterministic).

A GPU step's cost beyond SDPA is memory traffic: every extra elementwise pass reads and writes an
output-sized buffer. This script counts it without a GPU, two ways, each over one layer's forward
and backward under a ``TorchDispatchMode`` (which sees every aten op: the module's, the backward
formulas', AccumulateGrad's, and those inside the bodies of custom autograd Functions, forward and
backward; not the scratch buffers a kernel allocates inside itself, e.g. SDPA's):

* ``bytes written`` (``_Written``): the bytes each op writes: its outputs, or the tensors it mutates
  for in-place / ``out=`` ops; an allocation (``empty_like``, ...) writes nothing and counts 0; views
  count nothing. Counted on the second step after a warm-up, gradients accumulating (``.grad +=``).
  Beside it, ``saved_tensors_hooks`` record the bytes autograd saves for the backward.
* ``output bytes`` (``_OutputBytes``, written apart from the first): the bytes of every tensor every
  op returns, views and aliases excepted (an op whose schema marks its return as an alias, or whose
  outputs all share an input's storage without writing: ``view``, ``slice``, ``transpose``,
  ``expand``, ``_unsafe_view``, ...). In-place and ``out=`` ops count (their return is the tensor they
  write), and so do allocations (new memory): a buffer made by ``empty_like`` and then filled by an
  ``out=`` op counts twice, a buffer an out-of-place op returns once. Counted on a training step
  after a warm-up with every gradient ``None`` (what ``optimizer.zero_grad()`` leaves), so
  AccumulateGrad stores the gradients instead of adding them.

Each setting is compared with k = 0 (plain SDPA) on the same layer: extra aten ops (how many, which:
the multiset difference), extra bytes as a share of the k = 0 layer's, and in output-sized passes
(one pass = the bytes of the attention output ``(B, H, T, D)``).

Layers: timm ViT-S attention (``lapheads.timm.LaplacianAttention``, the class ``lapheads.timm.convert``
gives ``vit_small_patch16_224``'s attention: 384 wide, 6 heads, qkv bias; B=4, T=197) and one Hugging
Face Llama decoder layer with 8 query / 2 key-value heads of 64 (``LlamaModel`` with one layer, 512
wide, MLP 1408, B=2, T=256, built through ``lapheads.transformers.enable``), float32. Settings: k=0,
half the heads, all, arbitrary indices (``[0, 2]`` of 6 / ``[1, 4, 6]`` of 8), learnable mixing
(``"learn:laplacian"``). The shares grow with the batch (the parameter gradients are a fixed part of
the k = 0 layer's bytes): ``--vit-batch`` / ``--llama-batch`` change it.

Usage: ``python benchmarks/epilogue.py`` (a Markdown section on stdout; ``--json PATH`` writes the
rows; ``--quick`` changes nothing, the counts are exact and take seconds). ``measure()`` is what
the test suite asserts its bounds on (``tests/test_epilogue.py``).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

#: ops that allocate without writing: counted as ops, 0 bytes written.
_ALLOCATE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class _Written(TorchDispatchMode):
    """Counts the aten ops that write memory and the bytes each writes (its outputs, or the arguments
    it mutates); views (``slice``, ``expand``, ``transpose``, ...) write nothing and are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.written = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__)
        schema = func._schema
        mutated = []
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                val = kwargs.get(a.name) if a.name in kwargs else (args[i] if i < len(args) else None)
                mutated.extend(t for t in tree_flatten(val)[0] if isinstance(t, torch.Tensor))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if mutated:
            written = mutated
        elif any(r.alias_info is not None for r in schema.returns) or (
            outputs and all(t.untyped_storage().data_ptr() in inputs for t in outputs)
        ):
            return out  # a view (``_unsafe_view`` too): nothing written, not counted
        else:
            written = outputs
        self.ops[name] += 1
        if name not in _ALLOCATE:
            self.written += sum(t.numel() * t.element_size() for t in written)
        return out


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


class _OutputBytes(TorchDispatchMode):
    """The bytes of every tensor every aten op returns, except an op's outputs that alias its inputs and
    are not written (views); in-place ops count their return (what they write), allocations theirs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        returns = func._schema.returns
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        if not writes:
            if any(r.alias_info is not None for r in returns):
                return out  # a view by its schema
            storages = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
            outputs = _tensors(out)
            if outputs and all(t.untyped_storage().data_ptr() in storages for t in outputs):
                return out  # an alias by its storage (``_unsafe_view``, ``alias``, ``detach``)
        self.ops[str(func.overloadpacket.__name__)] += 1
        self.bytes += sum(t.numel() * t.element_size() for t in _tensors(out))
        return out


def _count_outputs(step: Callable[[], None], leaves: list[torch.Tensor]) -> dict[str, Any]:
    for t in leaves:
        t.grad = None
    counter = _OutputBytes()
    with counter:
        step()
    return {"ops": counter.ops, "bytes": counter.bytes}


def _count(step: Callable[[], None]) -> dict[str, Any]:
    saved: dict[Any, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        saved[key] = t.numel() * t.element_size()
        return t

    counter = _Written()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
        step()
    return {"ops": counter.ops, "written": counter.written, "saved": sum(saved.values())}


Layer = tuple[Callable[[], None], int, list[torch.Tensor]]  # (one step, output bytes, leaves with gradients)


def _vit_layer(spec: Any, b: int = 4) -> Layer:
    from lapheads.timm import LaplacianAttention

    torch.manual_seed(0)
    t, dim, heads = 197, 384, 6
    if isinstance(spec, list):
        spec = spec[0]  # one layer: its head indices
    layer = LaplacianAttention(dim, heads, qkv_bias=True, laplacian_heads=spec)
    x = torch.randn(b, t, dim, requires_grad=True)
    g = torch.randn(b, t, dim)

    def step() -> None:
        layer(x).backward(g)

    return step, b * heads * t * (dim // heads) * 4, [*layer.parameters(), x]


def _llama_model(spec: Any, heads: int = 8, kv: int = 2, layers: int = 1) -> Any:
    from transformers import LlamaConfig, LlamaModel

    import lapheads.transformers as lt

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=heads * 64,
        intermediate_size=1408,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=layers,
        vocab_size=64,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    model = LlamaModel(cfg)
    lt.enable(model, spec)
    return model


def _llama_layer(spec: Any, b: int = 2) -> Layer:
    model = _llama_model(spec)
    t, dim = 256, 512
    x = torch.randn(b, t, dim, requires_grad=True)
    g = torch.randn(b, t, dim)

    def step() -> None:
        model(inputs_embeds=x, use_cache=False).last_hidden_state.backward(g)

    return step, b * 8 * t * 64 * 4, [*model.parameters(), x]


#: name (with ``{b}`` for the batch) -> (builder, default batch, heads, the indices setting)
LAYERS: dict[str, tuple[Callable[[Any, int], Layer], int, int, list[int]]] = {
    "timm ViT-S attention, B={b}, T=197": (_vit_layer, 4, 6, [0, 2]),
    "HF Llama layer, 8 q / 2 kv heads, B={b}, T=256": (_llama_layer, 2, 8, [1, 4, 6]),
}


def settings(n_heads: int, indices: list[int]) -> dict[str, Any]:
    """The measured settings of a layer with ``n_heads`` heads: label -> spec."""
    return {
        "k=0": 0,
        f"k={n_heads // 2} of {n_heads}": n_heads // 2,
        f"k={n_heads}": "all",
        f"indices {indices}": [indices],
        "learn": "learn:laplacian",
    }


def _diff(ops: collections.Counter[str], base: collections.Counter[str]) -> str:
    plus = ops - base
    minus = base - ops
    parts = [f"{n} {name}" if n > 1 else name for name, n in sorted(plus.items())]
    parts += [f"-{n} {name}" if n > 1 else f"-{name}" for name, n in sorted(minus.items())]
    return ", ".join(parts) or "-"


def measure(batches: Optional[list[Optional[int]]] = None) -> list[dict[str, Any]]:
    """One row per layer and setting: extra ops (count and names), extra bytes written and saved, extra
    output bytes; ``batches``: one batch size per layer of :data:`LAYERS` (None: its default)."""
    rows = []
    for i, (name, (build, default_b, n_heads, indices)) in enumerate(LAYERS.items()):
        b = (batches[i] if batches else None) or default_b
        layer = name.format(b=b)
        base = base_out = None
        for label, spec in settings(n_heads, indices).items():
            step, out_bytes, leaves = build(spec, b)
            step()  # warm-up: lazy initialisation (masks, caches) is not counted
            got = _count(step)
            outs = _count_outputs(step, leaves)
            if base is None or base_out is None:
                base, base_out = got, outs
            extra_ops = sum(got["ops"].values()) - sum(base["ops"].values())
            rows.append(
                {
                    "layer": layer,
                    "setting": label,
                    "extra_ops": extra_ops,
                    "extra_op_names": sorted((got["ops"] - base["ops"]).elements()),
                    "what": _diff(got["ops"], base["ops"]),
                    "extra_written": (got["written"] - base["written"]) / base["written"],
                    "extra_passes": (got["written"] - base["written"]) / out_bytes,
                    "extra_saved": (got["saved"] - base["saved"]) / base["saved"],
                    "extra_saved_passes": (got["saved"] - base["saved"]) / out_bytes,
                    "extra_output_bytes": (outs["bytes"] - base_out["bytes"]) / base_out["bytes"],
                    "extra_output_passes": (outs["bytes"] - base_out["bytes"]) / out_bytes,
                    "output_what": _diff(outs["ops"], base_out["ops"]),
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| layer | setting | extra aten ops | extra bytes written | passes written | extra saved "
        "| extra output bytes | output passes | what is extra |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    last = None
    for r in rows:
        layer = r["layer"] if r["layer"] != last else ""
        last = r["layer"]
        lines.append(
            f"| {layer} | {r['setting']} | {r['extra_ops']:+d} | {100 * r['extra_written']:+.1f}% | "
            f"{r['extra_passes']:+.2f} | {100 * r['extra_saved']:+.1f}% | {100 * r['extra_output_bytes']:+.1f}% | "
            f"{r['extra_output_passes']:+.2f} | {r['what']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--quick", action="store_true", help="accepted for run_all.py: the counts are cheap and exact")
    ap.add_argument("--vit-batch", type=int, help="batch of the ViT-S layer (default 4)")
    ap.add_argument("--llama-batch", type=int, help="batch of the Llama layer (default 2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure([args.vit_batch, args.llama_batch])
    print("## epilogue: what the heads add to one attention layer (op counts, CPU)\n")
    print(
        "One layer's forward + backward beyond k = 0 (plain SDPA), counted op by op (float32): bytes written "
        "by every aten op (allocations 0; gradients accumulating) and in output-sized passes, bytes saved for "
        "backward, and the independent count: bytes of every op's outputs, views aside (allocations and "
        "in-place ops included; gradients None before the step). What is extra: the ops beyond k = 0 of the "
        "first count.\n"
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
