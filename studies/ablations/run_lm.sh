#!/usr/bin/env bash
# The tiny-LM ablation study (width 64, 200 steps, as studies/learnable): every setting and XSA,
# seeds interleaved, one run at a time on one thread. Usage: run_lm.sh OUT [SEEDS]
set -uo pipefail
out=${1:?usage: run_lm.sh OUT [SEEDS]}
seeds=${2:-0 1 2}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
lapheads=${LAPHEADS:-lapheads}
common=(--config lm/tiny --set train.threads=1 --set model.width=64 --set train.max_steps=200
        --set train.eval_every=20 --analyze --no-report)
# (the variants need model.laplacian_heads=0 before the grid point is checked)
for s in $seeds; do
  nice -n 5 "$lapheads" sweep "${common[@]}" --laplacian-heads 0,2,all,identity:2,negated:2 --seeds "$s" \
    --out "$out/heads_s$s" || echo "heads seed $s: a point failed"
  # differential attention is classify-only (docs/heads.md); XSA in every layer
  nice -n 5 "$lapheads" sweep "${common[@]}" --set model.laplacian_heads=0 --laplacian-heads 0 --grid model.attention=xsa --seeds "$s" \
    --out "$out/variants_s$s" || echo "variants seed $s: a point failed"
done
