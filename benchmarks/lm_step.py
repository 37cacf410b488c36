"""Benchmark: training throughput of a NanoChat-style LM with k = 0, 3, 6 Laplacian heads per layer.

Model: width 768, 6 layers, 6 heads of 128 (nanochat's depth rule at width 768), relu^2 MLP, the
transformers ``NanoChatForCausalLM`` built by :mod:`lapheads.lm.model`, vocabulary ``--vocab``.
One measured step = forward + backward of one micro-batch (``--batch`` x ``--seq`` tokens, float32),
where Laplacian heads cost something; ``--with-optimizer`` adds the Muon + AdamW update, which is
identical for every k and on a CPU dominated by Muon's bfloat16 Newton-Schulz iterations (about
25 s per step for this model on a loaded 2-core machine), so by default it is left out.

Time: the three models are warmed up, then measured INTERLEAVED round by round
(benchmarks/_common.py); tokens/s from the median step time; ratios k/k=0 are medians of
per-round ratios (same machine load). Model FLOP utilisation (MFU) = flops_per_token x tokens/s /
peak, with nanochat's flops_per_token (``6 x non-embedding params + 12 x layers x heads x head_dim x
seq``; :func:`lapheads.lm.model.flops_per_token`) and the peak measured in the same run as the
best float32 matmul throughput (``--peak-n`` square matrices). Targets printed: time ratio to k=0
<= 1.03; MFU of k>0 >= MFU of k=0 (the FLOP count is the same for every k, so this is the same
statement as the ratio <= 1, reported honestly).

Usage: ``python benchmarks/lm_step.py [--quick] [--threads N]``. Markdown on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import machine_line, markdown_table, medians, paired_ratio, time_interleaved  # noqa: E402

from lapheads.lm.model import LMModelConfig, LMOptimConfig, build_model, build_optimizers, flops_per_token  # noqa: E402


def matmul_peak(n: int, repeats: int = 5) -> float:
    """Best float32 matmul throughput (FLOP/s) of ``n x n @ n x n`` on this machine, now."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up (thread pool, packing buffers)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
    return best


def make_step(k: int | str, args: argparse.Namespace):
    """A closure doing one training step of the model with k Laplacian heads per layer (or ``"learn"``:
    learnable mixing a_h I + b_h P in every head, SDPA then ``ops._MixHeads``)."""
    torch.manual_seed(0)
    cfg = LMModelConfig(depth=6, width=768, n_heads=6, laplacian_heads=k)
    model = build_model(cfg, args.vocab, args.seq)
    # nanochat's zero init of lm_head/o_proj would make the first backward passes trivially sparse
    # in effect (zero gradients into the blocks); randomise them so every step does full work.
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(0, 0.02)
    opts = build_optimizers(model, LMOptimConfig())
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)

    def step() -> None:
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        if args.with_optimizer:
            for o in opts:
                o.step()
        for o in opts:
            o.zero_grad(set_to_none=True)

    return model, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--with-optimizer", action="store_true", help="time the Muon + AdamW update too")
    ap.add_argument("--peak-n", type=int, default=2048)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else args.repeats
    ks = (0, 3, 6, "learn")
    steps, fpt = {}, None
    for k in ks:
        model, steps[f"k={k}"] = make_step(k, args)
        fpt = flops_per_token(model, args.seq)  # identical for every k
        print(f"built k={k}", file=sys.stderr)
    peak_before = matmul_peak(args.peak_n)
    times = time_interleaved(steps, warmup=1, repeats=repeats)
    peak = max(peak_before, matmul_peak(args.peak_n))
    med = medians(times)
    tokens = args.batch * args.seq
    rows = []
    for k in ks:
        name = f"k={k}"
        tps = tokens / med[name]
        mfu = fpt * tps / peak
        ratio = paired_ratio(times, name, "k=0") if k else 1.0
        rows.append((name, f"{med[name] * 1e3:.0f}", f"{tps:,.0f}", f"{ratio:.3f}", f"{100 * mfu:.1f}%"))
        print(f"{name}: {med[name]:.3f} s/step, ratio {ratio:.3f}, MFU {100 * mfu:.1f}%", file=sys.stderr)
    r3 = paired_ratio(times, "k=3", "k=0")
    r6 = paired_ratio(times, "k=6", "k=0")
    r_learn = paired_ratio(times, "k=learn", "k=0")
    ok_ratio = max(r3, r6) <= 1.03
    ok_mfu = min(r3, r6) <= 1.0
    print("## LM training step: NanoChat width 768, 6 layers, k Laplacian heads (benchmarks/lm_step.py)\n")
    print(
        f"{machine_line()}; batch {args.batch} x seq {args.seq} tokens, vocab {args.vocab}, float32, "
        f"forward + backward{' + Muon/AdamW update' if args.with_optimizer else ''}; {repeats} interleaved rounds, medians.\n"
    )
    print(markdown_table(("model", "ms/step", "tokens/s", "time ratio to k=0", "MFU"), rows))
    print(
        f"\nMFU = {fpt / 1e6:.1f} MFLOP/token x tokens/s / peak; peak = best {args.peak_n}^3 float32 matmul "
        f"in this run = {peak / 1e9:.1f} GFLOP/s.\n"
    )
    print(f"- target time ratio <= 1.03: k=3 {r3:.3f}, k=6 {r6:.3f} -> {'met' if ok_ratio else 'NOT met'}")
    print(
        f"- target learnable mixing (k=learn) time ratio <= 1.02: {r_learn:.3f} -> "
        f"{'met' if r_learn <= 1.02 else 'NOT met'}"
    )
    print(
        f"- target MFU of k>0 >= MFU of k=0: {'met' if ok_mfu else 'NOT met'} "
        f"(k>0 does the same FLOPs plus one subtraction per head output, so MFU falls by the time ratio)"
    )


if __name__ == "__main__":
    main()
