"""A tiny finished `lapheads train lm` run, shared by the SFT and evaluation tests."""

from __future__ import annotations

from pathlib import Path

from lapheads.engine.config import load_config
from lapheads.engine.launch import launch
from lapheads.recipes import lm as R


def tiny_lm_run(root: Path, laplacian_heads: str, steps: int) -> Path:
    """Train a 2-layer, 64-wide NanoChat model for ``steps`` steps on the embedded corpus."""
    cfg = load_config(R.LMConfig, None, [
        f"data.cache_dir={root / 'cache'}", "data.vocab_size=400", "data.seq_len=64", "data.batch_size=4",
        "data.eval_tokens=512", "model.depth=2", "model.width=64", "model.n_heads=4",
        f"model.laplacian_heads={laplacian_heads}", "samples.max_new_tokens=0", f"train.max_steps={steps}",
        "train.progress=false"])
    launch("lm", cfg, lambda c, i: R.build_task(c, i), str(root / "lm"))
    return root / "lm"
