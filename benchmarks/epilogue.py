"""What the Laplacian heads add to one attention layer, counted op by op on the CPU (deterministic).

A GPU step's cost beyond SDPA is memory traffic: every extra elementwise pass reads and writes an
output-sized buffer. This script counts that traffic without a GPU: one layer's forward and
backward run under a ``TorchDispatchMode`` that records every aten op and the bytes it writes
(the bytes of its outputs, or of the tensors it mutates for in-place / ``out=`` ops), and under
``saved_tensors_hooks`` that record the bytes autograd saves for the backward. Each setting is
compared with k = 0 (plain SDPA) on the same layer:

* ``extra aten ops``: how many more aten calls, and which (the multiset difference);
* ``extra bytes written``: as a share of the k = 0 layer's bytes written, and in output-sized passes
  (one pass = the bytes of the attention output ``(B, H, T, D)``);
* ``extra saved``: bytes saved for backward beyond k = 0, as a share of k = 0's.

Layers: timm ViT-S attention (``lapheads.timm.LaplacianAttention``, 384 wide, 6 heads, B=4,
T=197) and one Hugging Face Llama decoder layer with 8 query / 2 key-value heads of 64
(``LlamaModel`` with one layer, 512 wide, MLP 1408, B=2, T=256, built through
``lapheads.transformers.enable``), float32. Settings: k=0, half the heads, all, arbitrary indices
(``[0, 2]`` of 6 / ``[1, 4, 6]`` of 8), learnable mixing (``"learn:laplacian"``).

Usage: ``python benchmarks/epilogue.py`` (a Markdown section on stdout; ``--json PATH`` writes the
rows; ``--quick`` changes nothing, the counts are exact and take seconds). ``measure()`` is what
the test suite asserts its bounds on (``tests/test_epilogue.py``).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

#: ops that allocate without writing: counted as ops, 0 bytes written.
_ALLOCATE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class _Counter(TorchDispatchMode):
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


def _count(step: Callable[[], None]) -> dict[str, Any]:
    saved: dict[Any, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        saved[key] = t.numel() * t.element_size()
        return t

    counter = _Counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
        step()
    return {"ops": counter.ops, "written": counter.written, "saved": sum(saved.values())}


def _vit_layer(spec: Any) -> tuple[Callable[[], None], int]:
    from lapheads.timm import LaplacianAttention

    torch.manual_seed(0)
    b, t, dim, heads = 4, 197, 384, 6
    if isinstance(spec, list):
        spec = spec[0]  # one layer: its head indices
    layer = LaplacianAttention(dim, heads, qkv_bias=True, laplacian_heads=spec)
    x = torch.randn(b, t, dim, requires_grad=True)
    g = torch.randn(b, t, dim)

    def step() -> None:
        layer(x).backward(g)

    return step, b * heads * t * (dim // heads) * 4


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


def _llama_layer(spec: Any) -> tuple[Callable[[], None], int]:
    model = _llama_model(spec)
    b, t, dim = 2, 256, 512
    x = torch.randn(b, t, dim, requires_grad=True)
    g = torch.randn(b, t, dim)

    def step() -> None:
        model(inputs_embeds=x, use_cache=False).last_hidden_state.backward(g)

    return step, b * 8 * t * 64 * 4


LAYERS: dict[str, tuple[Callable[[Any], tuple[Callable[[], None], int]], int, list[int]]] = {
    "timm ViT-S attention, B=4, T=197": (_vit_layer, 6, [0, 2]),
    "HF Llama layer, 8 q / 2 kv heads, B=2, T=256": (_llama_layer, 8, [1, 4, 6]),
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


def measure() -> list[dict[str, Any]]:
    """One row per layer and setting: extra ops (count and names), extra bytes written and saved."""
    rows = []
    for layer, (build, n_heads, indices) in LAYERS.items():
        base = None
        for label, spec in settings(n_heads, indices).items():
            step, out_bytes = build(spec)
            step()  # warm-up: lazy initialisation (masks, caches) is not counted
            got = _count(step)
            if base is None:
                base = got
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
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| layer | setting | extra aten ops | extra bytes written | output-sized passes | extra saved | what is extra |",
        "|---|---|---|---|---|---|---|",
    ]
    last = None
    for r in rows:
        layer = r["layer"] if r["layer"] != last else ""
        last = r["layer"]
        lines.append(
            f"| {layer} | {r['setting']} | {r['extra_ops']:+d} | {100 * r['extra_written']:+.1f}% | "
            f"{r['extra_passes']:+.2f} | {100 * r['extra_saved']:+.1f}% | {r['what']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--quick", action="store_true", help="accepted for run_all.py: the counts are cheap and exact")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure()
    print("## epilogue: what the heads add to one attention layer (op counts, CPU)\n")
    print(
        "One layer's forward + backward beyond k = 0 (plain SDPA), counted op by op: bytes written by "
        "every aten op, in output-sized passes, and bytes saved for backward (float32).\n"
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
