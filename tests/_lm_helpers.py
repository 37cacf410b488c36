"""A tiny finished `lapheads train lm` run and a local lm-eval task, shared by the LM tests."""

from __future__ import annotations

import json
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


def offline(monkeypatch, datasets_cache: Path) -> None:
    """Hub and ``datasets`` offline for one test, as ``HF_*_OFFLINE=1`` at start-up would make them.

    The variables are read when the libraries are imported, which has happened by now (transformers
    imports huggingface_hub), so the module switches are set too; the teardown restores all of it.
    """
    import huggingface_hub.constants as hub

    monkeypatch.setenv("HF_DATASETS_CACHE", str(datasets_cache))
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(k, "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    try:
        import datasets.config as ds
    except ImportError:
        return
    monkeypatch.setattr(ds, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(ds, "HF_DATASETS_OFFLINE", True)


def local_mc_task(tmp_path: Path, task: str) -> Path:
    """A folder with one lm-eval multiple-choice task YAML (named ``task``) over 3 local JSONL items,
    for ``--include_path`` / ``--lm-eval-include``; nothing is downloaded."""
    items = [{"question": "The keyword that defines a function is", "choices": ["def", "class", "import"], "label": 0},
             {"question": "A list literal uses", "choices": ["square brackets", "colons", "dollars"], "label": 0},
             {"question": "None is", "choices": ["a singleton", "a module", "a file"], "label": 0}]
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(i) + "\n" for i in items))
    d = tmp_path / "tasks"
    d.mkdir()
    (d / "tiny_mc.yaml").write_text(
        f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"
        "    aggregation: mean\n    higher_is_better: true\n")
    return d


def greedy_by_recompute(model, ids, n_new: int):
    """``ids`` extended by ``n_new`` greedy tokens, each from a full forward pass without a cache:
    the reference that ``model.generate(..., do_sample=False)`` with a KV cache must equal."""
    import torch
    seq = ids
    with torch.no_grad():
        for _ in range(n_new):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq
