#!/usr/bin/env bash
# The digits ViT ablation study: every setting and variant, seeds interleaved (every setting of one
# seed before the next seed), one run at a time on one thread. Usage: run_digits.sh OUT [SEEDS]
# A failed point is logged and the study goes on (the report shows what is missing).
set -uo pipefail
out=${1:?usage: run_digits.sh OUT [SEEDS]}
seeds=${2:-0 1 2}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
lapheads=${LAPHEADS:-lapheads}
common=(--config classify/digits --set train.threads=1 --set train.eval_every=20 --analyze --no-report)
# (the variants need model.laplacian_heads=0 before the grid point is checked)
for s in $seeds; do
  # softmax attention: standard (k=0), Laplacian half / all, and the fixed ablations of half / all heads
  nice -n 5 "$lapheads" sweep "${common[@]}" --laplacian-heads 0,2,all,identity:2,negated:2,identity:4,negated:4 \
    --seeds "$s" --out "$out/heads_s$s" || echo "heads seed $s: a point failed"
  # the other attentions (every layer): timm's DiffAttention and XSA
  nice -n 5 "$lapheads" sweep "${common[@]}" --set model.laplacian_heads=0 --laplacian-heads 0 --grid model.attention=diff,xsa --seeds "$s" \
    --out "$out/variants_s$s" || echo "variants seed $s: a point failed"
done
