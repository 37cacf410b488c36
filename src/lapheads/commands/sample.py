"""``lapheads sample``: text from a language-model run (KV-cached generation)."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch

from ..engine.config import number_arg
from ..lm.sample import generate_text
from ..recipes import lm as lm_recipe  # called through the module (tests replace load_model)
from . import opts


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="lapheads sample", description="Sample text from a trained LM run (KV-cached).")
    p.add_argument(
        "--run",
        required=True,
        help="run directory of `lapheads train lm` / `train sft` (or a save_pretrained directory)",
    )
    p.add_argument("--prompt", required=True, help="text to continue (a user message with --chat)")
    p.add_argument("--max-new-tokens", type=number_arg(int, ge=1), default=64)
    p.add_argument(
        "--temperature", type=number_arg(float, ge=0.0), default=0.0, help="0 = greedy (default); ~0.6-1.0 for variety"
    )
    p.add_argument("--top-k", type=number_arg(int, ge=1), help="sample among the k most likely tokens")
    p.add_argument("--num-samples", type=number_arg(int, ge=1), default=1)
    p.add_argument("--chat", action="store_true", help="render the prompt as a chat user turn (SFT runs)")
    p.add_argument("--weights", choices=["model", "ema"], default="model")
    p.add_argument("--device", default="auto", help="auto = cuda if available, else cpu")
    p.add_argument("--seed", type=number_arg(int), default=0)
    args = p.parse_args(list(argv) if argv is not None else None)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model, tok = lm_recipe.load_model(args.run, weights=args.weights, device=device)
    texts = generate_text(model, tok, **opts(args, "prompt max_new_tokens temperature top_k num_samples chat seed"))
    for i, t in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i}")
        print(t if args.chat else args.prompt + t)
    return 0
