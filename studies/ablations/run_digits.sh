#!/usr/bin/env bash
# The digits ViT ablation study: every setting and variant, seeds interleaved (seed 0 of every
# setting first), one run at a time on one thread. Usage: run_digits.sh OUT [SEEDS]
set -euo pipefail
out=${1:?usage: run_digits.sh OUT [SEEDS]}
seeds=${2:-0 1 2}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
lapheads=${LAPHEADS:-lapheads}
common=(--config classify/digits --set train.threads=1 --set train.eval_every=20 --analyze --no-report)
for s in $seeds; do
  # softmax attention: standard (k=0), Laplacian half / all, and the ablations of all 4 heads
  nice -n 5 "$lapheads" sweep "${common[@]}" --laplacian-heads 0,2,all,identity:4,negated:4 --seeds "$s" \
    --out "$out/heads_s$s"
  # the other attentions (every layer): timm's DiffAttention and XSA
  nice -n 5 "$lapheads" sweep "${common[@]}" --laplacian-heads 0 --grid model.attention=diff,xsa --seeds "$s" \
    --out "$out/variants_s$s"
done
