"""GPU science pack: the ablation study (studies/ablations) at a scale one H100 resolves in about 8 minutes.

Every setting of the study, several seeds each, trained from scratch on Fashion-MNIST (60k training,
10k test images of 28 x 28) by one process:

* ``k=0`` (standard attention), ``k=H/2`` and ``k=H`` Laplacian heads, ``identity:H/2`` and
  ``identity:H`` (those heads output their own value V, no attention), ``negated:H/2`` and
  ``negated:H`` (``-P V``), ``diff`` (timm's ``DiffAttention``) and ``xsa`` (exclusive
  self-attention): the classify recipe's own model builder
  (:func:`lapheads.recipes.classify.build_model` with ``model.attention`` and
  ``model.laplacian_heads``), so the models are the recipe's.
* Model: a ViT of ``--depth`` blocks, ``--width`` wide, ``--heads`` heads, patches of 4 (49
  tokens + CLS), greyscale input, QK-norm; AdamW with linear warm-up and cosine decay, label
  smoothing 0.1, random horizontal flips and shifts of up to 2 pixels, done on the device.
* bf16 autocast and ``torch.compile`` on CUDA (``--compile``, ``--dtype``); float32 eager on the
  CPU. The whole data set lives on the device as uint8.
* Every run is evaluated on the test split after each epoch (top-1; the plateau flag of
  :func:`lapheads.stats.plateau` over the last 20% of the epochs), and its geometry is measured
  once at the end (:func:`lapheads.geometry.analyze_model` on ``--geometry-items`` test images:
  k99, the within-image share of token variance, and the token CDNV of the last block).
* Seeds are interleaved (seed 0 of every setting first), so a run cut by ``--budget-s`` costs
  seeds, not settings; a run that no longer fits the budget is reported as skipped, not hidden.
* The report (``OUT/report.md`` and ``OUT/results.json``): per setting the runs, plateaued runs,
  top-1 (mean ± std), the Welch comparison with k=0 (``lapheads.stats.compare``) and the geometry.

Data: ``benchmarks/prepare_fashion_mnist.sh runs/fashion-mnist`` copies the four idx files (31 MB)
from Debian's ``dataset-fashion-mnist`` package; ``--data`` takes any image spec of
:func:`lapheads.data.images.build_image_dataset` whose images are uint8 arrays (``digits`` for the
CPU smoke run).

Usage on the GPU machine (about 8 minutes on one H100 with the defaults)::

    python benchmarks/gpu_science.py --device cuda --data runs/fashion-mnist --out OUT

``--smoke`` (tiny model, one seed, two epochs of at most 512 images; what the test suite runs on
the CPU with ``--data digits``) checks the whole path.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import machine_line, markdown_table  # noqa: E402

from lapheads.data.images import build_image_dataset  # noqa: E402
from lapheads.engine.config import from_dict  # noqa: E402
from lapheads.geometry import analyze_model  # noqa: E402
from lapheads.recipes.classify import ModelConfig, build_model  # noqa: E402
from lapheads.stats import compare, plateau  # noqa: E402


def settings(heads: int) -> list[tuple[str, str, Any]]:
    """``(label, model.attention, model.laplacian_heads)`` of every setting of the study."""
    return [
        ("k=0", "laplacian", 0),
        (f"k={heads // 2}", "laplacian", heads // 2),
        ("all", "laplacian", "all"),
        (f"identity:{heads // 2}", "laplacian", f"identity:{heads // 2}"),
        (f"negated:{heads // 2}", "laplacian", f"negated:{heads // 2}"),
        (f"identity:{heads}", "laplacian", f"identity:{heads}"),
        (f"negated:{heads}", "laplacian", f"negated:{heads}"),
        ("diff", "diff", 0),
        ("xsa", "xsa", 0),
    ]


def _arrays(spec: str, split: str, device: torch.device, limit: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    ds = build_image_dataset(spec, split=split)
    images = np.asarray(ds.images)
    if images.ndim != 3:
        raise SystemExit(f"--data {spec}: greyscale uint8 images (N, H, W) expected, got {images.shape}")
    n = min(limit, len(images)) if limit else len(images)
    x = torch.from_numpy(images[:n]).to(device).unsqueeze(1)  # (N, 1, H, W) uint8
    y = torch.as_tensor(np.asarray(ds.targets)[:n], dtype=torch.long, device=device)
    return x, y, ds.num_classes


def _normalise(x: torch.Tensor, size: int) -> torch.Tensor:
    x = x.float().div_(255.0).sub_(0.5).div_(0.5)
    return x if x.shape[-1] == size else F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)


def _augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random horizontal flip and a shift of up to 2 pixels (zero padding), per image, on the device."""
    b, _, h, w = x.shape
    flip = torch.rand(b, generator=gen, device=x.device) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    pad = F.pad(x, (2, 2, 2, 2), value=-1.0)
    dy = torch.randint(0, 5, (b,), generator=gen, device=x.device)
    dx = torch.randint(0, 5, (b,), generator=gen, device=x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device))[:, None, :, None].expand(b, 1, h, w + 4)
    x = pad.gather(2, rows)
    cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, None, :].expand(b, 1, h, w)
    return x.gather(3, cols)


@torch.no_grad()
def _top1(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, size: int, batch: int, amp: Any) -> float:
    model.eval()
    hits = 0
    for i in range(0, len(x), batch):
        with amp():
            hits += int((model(_normalise(x[i : i + batch], size)).argmax(1) == y[i : i + batch]).sum())
    model.train()
    return hits / len(x)


def _geometry(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, size: int, device: torch.device) -> dict:
    batches = [(_normalise(x[i : i + 256], size), y[i : i + 256]) for i in range(0, len(x), 256)]
    geo = analyze_model(model.float(), batches, "vit", device=device, acc_device=device, nc4=False)
    blocks = [n for n in geo["layers"] if n != "pre_logits"]
    last = geo["layers"][blocks[-1]]

    def num(section: str, key: str) -> Optional[float]:
        v = last.get(section, {}).get(key)
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None

    return {
        "k99": num("spectra", "k_mean"),
        "within_seq": num("anova", "frac_within_sequence"),
        "cdnv": num("nc_tokens", "cdnv"),
    }


#: setting label -> (model, its compiled forward): later seeds load a fresh initialisation into the
#: same module, so ``torch.compile`` compiles each setting once, not once per seed
_COMPILED: dict[str, tuple[torch.nn.Module, Any]] = {}


def train_one(
    args: argparse.Namespace, label: str, attention: str, heads: Any, seed: int, data: dict, device: torch.device
) -> dict:
    """Train one setting and seed; its final top-1, per-epoch curve, plateau flag and geometry."""
    torch.manual_seed(seed)
    cfg = from_dict(
        ModelConfig,
        {
            "name": "vit_tiny_patch16_224",
            "img_size": args.img_size,
            "in_chans": 1,
            "patch_size": 4,
            "embed_dim": args.width,
            "depth": args.depth,
            "num_heads": args.heads,
            "qk_norm": True,
            "laplacian_heads": heads,
            "attention": attention,
        },
    )
    fresh = build_model(cfg, data["classes"]).to(device)  # this seed's initialisation
    if args.compile == "on" and label in _COMPILED:
        model, step_fn = _COMPILED[label]
        model.load_state_dict(fresh.state_dict())
    else:
        model = fresh
        step_fn = torch.compile(model) if args.compile == "on" else model
        if args.compile == "on":
            _COMPILED[label] = (model, step_fn)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and not n.endswith(("pos_embed", "cls_token"))]
    other = [p for n, p in model.named_parameters() if not (p.ndim > 1 and not n.endswith(("pos_embed", "cls_token")))]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=args.lr,
        fused=device.type == "cuda",
    )
    x, y = data["train"]
    steps_per_epoch = max(1, len(x) // args.batch_size)
    total = steps_per_epoch * args.epochs
    warm = max(1, int(0.05 * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm)))
    )
    bf16 = args.dtype == "bf16"

    def amp() -> Any:
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    gen = torch.Generator(device=device).manual_seed(seed)
    curve: list[tuple[int, float]] = []
    t0 = time.time()
    model.train()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=gen, device=device)
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            xb = _augment(_normalise(x[idx], args.img_size), gen)
            with amp():
                loss = F.cross_entropy(step_fn(xb).float(), y[idx], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
        if not math.isfinite(float(loss.detach())):
            raise SystemExit(f"{label} seed {seed}: the loss is {float(loss.detach())} at epoch {epoch + 1}")
        curve.append(((epoch + 1) * steps_per_epoch, _top1(model, *data["test"], args.img_size, 1024, amp)))
    seconds = time.time() - t0
    gx, gy = data["test"]
    geo = _geometry(model, gx[: args.geometry_items], gy[: args.geometry_items], args.img_size, device)
    flag = plateau([s for s, _ in curve], [v for _, v in curve])
    return {
        "setting": label,
        "seed": seed,
        "top1": curve[-1][1],
        "curve": curve,
        "plateau": flag.status,
        "plateau_change": flag.rel_change,
        "train_seconds": round(seconds, 2),
        **geo,
    }


def _mean_std(xs: list[Optional[float]]) -> str:
    a = np.asarray([v for v in xs if v is not None], dtype=float)
    if a.size == 0:
        return "-"
    return f"{a.mean():.4g} ± {a.std(ddof=1):.2g}" if a.size > 1 else f"{a.mean():.4g}"


def report(runs: list[dict], skipped: list[str], args: argparse.Namespace, device_name: str) -> str:
    """The Markdown report: one row per setting, Welch against k=0 on top-1."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["setting"], []).append(r)
    base = [r["top1"] for r in by.get("k=0", [])]
    rows = []
    for label, rs in by.items():
        top = [r["top1"] for r in rs]
        if label == "k=0":
            cmp_text = "—"
        else:
            c = compare("k=0", base, label, top, want_lower=False)
            cmp_text = (
                f"{c.diff:+.4f} [{c.ci_low:+.4f}, {c.ci_high:+.4f}], p={c.p:.2g}"
                if c.p is not None
                else f"{c.diff:+.4f} ({c.verdict})"
            )
        rows.append(
            [
                label,
                str(len(rs)),
                f"{sum(r['plateau'] == 'yes' for r in rs)}/{len(rs)}",
                _mean_std(top),
                cmp_text,
                _mean_std([r["k99"] for r in rs]),
                _mean_std([r["within_seq"] for r in rs]),
                _mean_std([r["cdnv"] for r in rs]),
            ]
        )
    head = [
        "setting",
        "runs",
        "plateaued",
        "top-1 (mean ± std)",
        "Δ vs k=0 [95% CI], Welch p",
        "k99",
        "within-seq",
        "CDNV",
    ]
    lines = [
        "# GPU science pack: Laplacian heads, ablations and variants",
        "",
        f"- device: {device_name}; {machine_line()}",
        f"- data: {args.data} ({args.train_items or 'all'} training images, {args.test_items or 'all'} test images)",
        f"- model: ViT depth {args.depth}, width {args.width}, {args.heads} heads, patch 4, {args.img_size} px; "
        f"{args.epochs} epochs of batch {args.batch_size}, AdamW lr {args.lr}; {args.dtype}, compile {args.compile}",
        f"- seeds: {args.seeds}; geometry on {args.geometry_items} test images (last block)",
        "",
        markdown_table(head, rows),
    ]
    if skipped:
        lines += ["", f"Skipped (time budget of {args.budget_s} s): {', '.join(skipped)}."]
    return "\n".join(lines) + "\n"


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="runs/fashion-mnist", help="image spec (an idx folder; digits for --smoke)")
    p.add_argument("--out", required=True, help="output folder (report.md, results.json)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2; --smoke: 0)")
    p.add_argument("--settings", default="", help="comma-separated labels to run (default: all of them)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--img-size", type=int, default=28)
    p.add_argument("--train-items", type=int, default=0, help="0 = every training image")
    p.add_argument("--test-items", type=int, default=0, help="0 = every test image")
    p.add_argument("--geometry-items", type=int, default=2000)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--compile", choices=["on", "off"], default=None, help="default: on on CUDA, off on the CPU")
    p.add_argument("--budget-s", type=float, default=450.0, help="stop starting runs after this many seconds")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: one seed, 2 epochs, 512 images")
    a = p.parse_args(argv)
    cuda = a.device.startswith("cuda")
    a.dtype = a.dtype or ("bf16" if cuda else "fp32")
    a.compile = a.compile or ("on" if cuda else "off")
    if a.smoke:
        a.seeds = a.seeds or "0"
        a.epochs, a.width, a.depth, a.heads, a.batch_size = 2, 32, 2, 2, 64
        a.train_items, a.test_items, a.geometry_items, a.img_size = 512, 256, 128, 16
    a.seeds = a.seeds or "0,1,2"
    return a


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if args.compile == "on":  # one compiled graph per setting (9) must stay cached: above dynamo's default 8
        torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
    tx, ty, classes = _arrays(args.data, "train", device, args.train_items)
    vx, vy, _ = _arrays(args.data, "val", device, args.test_items)
    data = {"train": (tx, ty), "test": (vx, vy), "classes": classes}
    chosen = settings(args.heads)
    if args.settings:
        want = [s.strip() for s in args.settings.split(",")]
        unknown = sorted(set(want) - {s[0] for s in chosen})
        if unknown:
            raise SystemExit(f"--settings: unknown {unknown}; known: {[s[0] for s in chosen]}")
        chosen = [s for s in chosen if s[0] in want]
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    runs: list[dict] = []
    skipped: list[str] = []
    longest = 0.0
    for seed in seeds:
        for label, attention, heads in chosen:
            elapsed = time.time() - start
            if elapsed + longest > args.budget_s:
                skipped.append(f"{label} seed {seed}")
                continue
            t0 = time.time()
            r = train_one(args, label, attention, heads, seed, data, device)
            longest = max(longest, time.time() - t0)
            runs.append(r)
            print(f"{label} seed {seed}: top-1 {r['top1']:.4f}, {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    text = report(runs, skipped, args, name)
    (out / "report.md").write_text(text)
    (out / "results.json").write_text(
        json.dumps({"device": name, "args": vars(args), "runs": runs, "skipped": skipped}, indent=1)
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
