"""GPU check: what must be measured the first time an accelerator is available, as one table.

Rows (bf16 on CUDA; float32 and tiny sizes on the CPU, where the script is tested):

1. ``attention``: ``laplacian_attention(..., laplacian_heads="all")`` against plain SDPA under each
   CUDA SDPA backend (flash, memory-efficient, cuDNN, math; ``torch.nn.attention.sdpa_kernel``) at
   T = 1k / 4k / 16k (B=1, 8 heads of 64, forward + backward): time ratio and peak-memory ratio
   (``torch.cuda.max_memory_allocated`` over the step). A backend the GPU or shape does not support
   is reported as such, not hidden.
2. ``vit-s`` (DeiT-3 ViT-S/16 at 224, batch 168 = 33k tokens, timm) and ``nanochat-d12`` (depth
   12, width 768, 6 heads, vocab 65536, batch 16 x sequence 2048 = 32k tokens): one whole training
   step (forward, backward, AdamW / Muon + AdamW) in bf16 autocast with k = 0 / half / all Laplacian
   heads per layer and learnable mixing (``learn:laplacian``), ``torch.compile`` off and on. The
   variants of a model and mode are timed interleaved in the same rounds, and each row gives the
   throughput (images or tokens per second, MFU = model FLOPs per second / the GPU's dense bf16
   peak, from a table of known GPUs or ``--peak-tflops``) and its ratio to k = 0 (the median of
   per-round ratios). An A/A control (the k = 0 step timed twice under two names) says how far from
   1 a ratio moves by noise alone. FLOPs are PaLM's estimate (6 x matmul parameters per token plus
   the attention term, ``lapheads.lm.model.flops_per_token``), the same for ViT.
3. ``exact resume``: a tiny LM trained 50 steps on the device by the engine, against the same run
   restarted from its step-25 checkpoint (``--resume``): the largest weight difference, which must
   be 0 (deterministic algorithms on; cuBLAS workspace pinned).

Design choices:

* One process, one device, sizes fixed so the training table (``--only training``) ends in about
  6 minutes on one H100 (compilation included); ``--budget-s`` (default 450) stops measuring and
  marks the remaining rows "skipped (time budget)" rather than overrunning.
* Times are medians of interleaved rounds (``benchmarks/_common.py``), so a ratio's two variants see
  the same load; compile time is excluded (warm-up calls), but printed in the note column.
* ``--device cpu`` (the default without CUDA) or ``--tiny`` / ``--quick``: tiny sizes, float32, only
  the math backend; the test suite runs it this way (with ``--compile off``), so the script itself
  cannot rot while no GPU is lent.

Usage: ``python benchmarks/gpu_check.py --device cuda`` (Markdown table on stdout, progress on
stderr; ``--json PATH`` also writes the rows).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import machine_line, markdown_table, medians, paired_ratio, time_interleaved  # noqa: E402

# dense bf16 tensor-core peak (FLOP/s) by a substring of torch.cuda.get_device_name()
BF16_PEAK = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}
BACKENDS = ("flash", "efficient", "cudnn", "math")


class Budget:
    """Wall-clock budget: ``ok()`` turns False once ``seconds`` have passed since the start."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def ok(self) -> bool:
        return time.monotonic() < self.end


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops(device: torch.device, given: float) -> Optional[float]:
    if given > 0:
        return given * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, v in BF16_PEAK.items():
        if key in name:
            return v
    return None


def peak_memory(fn: Callable[[], None], device: torch.device) -> Optional[int]:
    """Bytes allocated at the peak of one call above what was allocated before (CUDA only)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - before


def timed(fns: dict[str, Callable[[], None]], device: torch.device, repeats: int) -> dict[str, list[float]]:
    def wrap(f: Callable[[], None]) -> Callable[[], None]:
        def g() -> None:
            f()
            sync(device)

        return g

    return time_interleaved({k: wrap(f) for k, f in fns.items()}, warmup=2, repeats=repeats)


# --------------------------------------------------------------------------- 1. attention
def attention_rows(
    device: torch.device, dtype: torch.dtype, sizes: list[int], heads: int, dim: int, repeats: int, budget: Budget
) -> list[list[Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lapheads import laplacian_attention

    enum = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    rows: list[list[Any]] = []
    backends = BACKENDS if device.type == "cuda" else ("math",)
    for backend in backends:
        for t in sizes:
            case = f"{backend}, T={t}"
            if not budget.ok():
                rows.append(["attention", case, "skipped (time budget)", "", ""])
                continue
            log(f"attention {case}")
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = [
                torch.randn(1, heads, t, dim, generator=g, device=device, dtype=dtype).requires_grad_()
                for _ in range(3)
            ]
            grad = torch.randn(1, heads, t, dim, generator=g, device=device, dtype=dtype)

            def step(fn: Callable[..., torch.Tensor], q=q, k=k, v=v, grad=grad, backend=backend) -> Callable[[], None]:
                def run() -> None:
                    q.grad = k.grad = v.grad = None
                    with sdpa_kernel([enum[backend]]):
                        fn(q, k, v).backward(grad)

                return run

            fns = {
                "sdpa": step(F.scaled_dot_product_attention),
                "laplacian": step(lambda a, b, c: laplacian_attention(a, b, c, laplacian_heads="all")),
            }
            try:
                fns["sdpa"]()
            except RuntimeError as e:  # "No available kernel" for this backend / dtype / shape
                rows.append(["attention", case, "unsupported: " + " ".join(str(e).split())[:80], "", ""])
                continue
            times = timed(fns, device, repeats)
            med = medians(times)
            mem = {n: peak_memory(f, device) for n, f in fns.items()}
            mem_ratio = f"x{mem['laplacian'] / mem['sdpa']:.3f}" if mem["sdpa"] else "n/a (cpu)"
            rows.append(
                [
                    "attention",
                    case,
                    f"sdpa {med['sdpa'] * 1e3:.3f} ms, laplacian {med['laplacian'] * 1e3:.3f} ms",
                    f"time x{paired_ratio(times, 'laplacian', 'sdpa'):.3f}, memory {mem_ratio}",
                    f"{str(dtype).replace('torch.', '')}, B=1, {heads}x{dim}",
                ]
            )
            del q, k, v, grad
    return rows


# --------------------------------------------------------------------------- 2. training steps
def vit_step(
    k: Any, device: torch.device, batch: int, img: int, bf16: bool
) -> tuple[torch.nn.Module, Callable[[Callable[..., Any]], Callable[[], None]], float]:
    """DeiT-3 ViT-S with head setting k in every layer: (model, step maker, FLOPs per step)."""
    import lapheads.timm as lap_timm
    from lapheads.heads import param_groups

    torch.manual_seed(0)
    model = lap_timm.create_model("deit3_small_patch16_224", laplacian_heads=k, img_size=img).to(device).train()
    groups = param_groups(model, lr=1e-4, weight_decay=0.05)
    opt = torch.optim.AdamW(groups, lr=1e-4, fused=device.type == "cuda")
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(batch, 3, img, img, generator=g, device=device)
    y = torch.randint(0, model.num_classes, (batch,), generator=g, device=device)
    blocks = len(model.blocks)
    tokens = (img // 16) ** 2 + 1
    width = model.embed_dim
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "pos_embed" not in n)
    flops = batch * tokens * (6.0 * matmul + 12.0 * blocks * width * tokens)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def step(m: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            with autocast:
                loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return run

    return model, step, flops


def lm_step(
    k: Any, device: torch.device, shape: dict[str, int], bf16: bool
) -> tuple[torch.nn.Module, Callable[[Callable[..., Any]], Callable[[], None]], float]:
    """NanoChat with head setting k in every layer (nanochat's optimizers): (model, step maker, FLOPs per step)."""
    from lapheads.lm.model import LMModelConfig, LMOptimConfig, build_model, build_optimizers, flops_per_token

    torch.manual_seed(0)
    cfg = LMModelConfig(depth=shape["depth"], width=shape["width"], n_heads=shape["heads"], laplacian_heads=k)
    model = build_model(cfg, shape["vocab"], shape["seq"], device=device)
    with torch.no_grad():  # nanochat's zero init would leave the first backward passes trivially sparse
        for p in model.parameters():
            if not p.any():
                p.normal_(0, 0.02)
    opts = build_optimizers(model, LMOptimConfig())
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g, device=device)
    y = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g, device=device)
    flops = flops_per_token(model, shape["seq"]) * x.numel()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def step(m: Callable[..., Any]) -> Callable[[], None]:
        def run() -> None:
            with autocast:
                logits = m(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)

        return run

    return model, step, flops


def training_rows(device: torch.device, args: argparse.Namespace, budget: Budget) -> list[list[Any]]:
    """Whole-step throughput of each head setting against k = 0, per model and compile mode.

    The variants of one model and mode (k = 0, half, all, learnable mixing) are built side by side
    and timed interleaved (``args.repeats`` rounds, each round runs every variant once), and each
    ratio is the median of the per-round ratios to k = 0. The A/A control times the k = 0 step a
    second time under another name in the same rounds: its ratio shows how far from 1 noise alone
    puts a ratio.
    """
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    peak = peak_flops(device, args.peak_tflops)
    rows: list[list[Any]] = []
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    if args.tiny:
        vit = dict(batch=2, img=32)
        lm = dict(depth=2, width=64, heads=4, vocab=256, seq=32, batch=2)
    else:  # at least 32k tokens per step: 168 x 197 = 33,096 image tokens, 16 x 2048 = 32,768 text tokens
        vit = dict(batch=168, img=224)
        lm = dict(depth=12, width=768, heads=6, vocab=65536, seq=2048, batch=16)
    vit_tokens = vit["batch"] * ((vit["img"] // 16) ** 2 + 1)
    models = [
        (
            "vit-s",
            6,
            lambda k: vit_step(k, device, vit["batch"], vit["img"], bf16),
            vit["batch"],
            "images/s",
            vit_tokens,
        ),
        (
            "nanochat-d12" if not args.tiny else "nanochat-tiny",
            lm["heads"],
            lambda k: lm_step(k, device, lm, bf16),
            lm["batch"] * lm["seq"],
            "tokens/s",
            lm["batch"] * lm["seq"],
        ),
    ]
    for name, heads, build, items, unit, tokens in models:
        settings: dict[str, Any] = {
            "k=0": 0,
            f"k={heads // 2}/{heads}": heads // 2,
            f"k={heads}/{heads}": heads,
            "learn": "learn:laplacian",
        }
        for compiled in compiles:
            mode = f"compile {'on' if compiled else 'off'}"
            labels = [*settings, "k=0 again (A/A)"]
            if not budget.ok():
                rows += [[name, f"{label}, {mode}", "skipped (time budget)", "", ""] for label in labels]
                continue
            steps: dict[str, Callable[[], None]] = {}
            flops: dict[str, float] = {}
            t0 = time.perf_counter()
            for label, spec in settings.items():
                log(f"{name} {label}, {mode}: build{' and compile' if compiled else ''}")
                model, make, flops[label] = build(spec)
                fwd: Callable[..., Any] = torch.compile(model, backend=args.compile_backend) if compiled else model
                steps[label] = make(fwd)
                steps[label]()  # a compilation happens here, not in the measured rounds
                sync(device)
            steps["k=0 again (A/A)"] = steps["k=0"]
            flops["k=0 again (A/A)"] = flops["k=0"]
            setup = time.perf_counter() - t0
            log(f"{name}, {mode}: {args.repeats} interleaved rounds of {len(steps)} steps")
            times = timed(steps, device, args.repeats)
            med = medians(times)
            note = f"{'bf16 autocast' if bf16 else 'float32'}, {tokens:,} tokens/step, {args.repeats} rounds"
            if compiled:
                note += f", build + compile {setup:.0f} s ({args.compile_backend})"
            for label in labels:
                mfu = f", MFU {flops[label] / med[label] / peak:.1%}" if peak else ""
                ratio = "" if label == "k=0" else f"throughput x{paired_ratio(times, 'k=0', label):.3f} vs k=0"
                rows.append([name, f"{label}, {mode}", f"{items / med[label]:,.0f} {unit}{mfu}", ratio, note])
            del steps
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- 3. exact resume
def resume_rows(device: torch.device, steps: int, budget: Budget) -> list[list[Any]]:
    if not budget.ok():
        return [["exact resume", f"{steps} steps", "skipped (time budget)", "", ""]]
    log(f"exact resume, {steps} steps on {device}")
    from lapheads.engine.checkpoint import load_tensors
    from lapheads.engine.config import load_config
    from lapheads.engine.launch import launch
    from lapheads.recipes import lm as R

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    half = steps // 2
    torch.use_deterministic_algorithms(True, warn_only=True)
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="lapheads-gpu-check-") as tmp:
        stack.callback(torch.use_deterministic_algorithms, False)
        root = Path(tmp)

        def cfg() -> Any:
            return load_config(
                R.LMConfig,
                None,
                [
                    f"data.cache_dir={root / 'cache'}",
                    "data.vocab_size=300",
                    "data.seq_len=32",
                    "data.batch_size=4",
                    "data.eval_tokens=256",
                    "model.depth=2",
                    "model.width=64",
                    "model.n_heads=4",
                    "model.laplacian_heads=2",
                    "samples.max_new_tokens=0",
                    f"train.max_steps={steps}",
                    f"train.ckpt_every={half}",
                    "train.keep_checkpoints=0",
                    "train.eval_every=0",
                    "train.progress=false",
                    f"train.device={device}",
                ],
            )

        build = lambda c, i: R.LMTask(c, i)  # noqa: E731
        t0 = time.perf_counter()
        launch("lm", cfg(), build, str(root / "full"))
        shutil.copytree(root / "full", root / "resumed")
        ckd = root / "resumed" / "checkpoints"
        for p in ckd.glob("step_*"):
            if p.name != f"step_{half:08d}":
                shutil.rmtree(p)
        (ckd / "latest").write_text(f"step_{half:08d}")
        shutil.rmtree(root / "resumed" / "final")
        launch("lm", cfg(), build, str(root / "resumed"), resume=True)
        a = load_tensors(root / "full" / "final" / "model.safetensors")
        b = load_tensors(root / "resumed" / "final" / "model.safetensors")
        diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        secs = time.perf_counter() - t0
    verdict = "exact" if diff == 0.0 else "DIFFERS"
    return [
        [
            "exact resume",
            f"{steps} steps vs {half} + resume {steps - half}",
            f"{verdict}: largest weight difference {diff:.3g}",
            "",
            f"{secs:.0f} s",
        ]
    ]


# --------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (implied on the CPU)")
    ap.add_argument("--quick", action="store_true", help="same as --tiny (benchmarks/run_all.py --quick)")
    ap.add_argument(
        "--compile",
        choices=("off", "on", "both"),
        default=None,
        help="torch.compile variants (default: both on CUDA, off on the CPU)",
    )
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--repeats", type=int, default=5, help="measured rounds per variant")
    ap.add_argument("--resume-steps", type=int, default=50)
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak, when the GPU is not in the table")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop measuring after this many seconds")
    ap.add_argument("--only", nargs="*", choices=("attention", "training", "resume"), default=None)
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    args.tiny = args.tiny or args.quick or device.type != "cuda"
    args.compile = args.compile or ("both" if device.type == "cuda" else "off")
    if args.resume_steps < 2:
        ap.error("--resume-steps must be >= 2")
    budget = Budget(args.budget_s)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    parts = args.only or ["attention", "training", "resume"]
    rows: list[list[Any]] = []
    t0 = time.perf_counter()
    if "attention" in parts:
        sizes = [32, 64, 128] if args.tiny else [1024, 4096, 16384]
        heads, dim = (2, 16) if args.tiny else (8, 64)
        rows += attention_rows(device, dtype, sizes, heads, dim, args.repeats, budget)
    if "training" in parts:
        rows += training_rows(device, args, budget)
    if "resume" in parts:
        rows += resume_rows(device, args.resume_steps, budget)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# GPU check on {where}{' (tiny sizes)' if args.tiny else ''}\n")
    print(machine_line() + f"; {time.perf_counter() - t0:.0f} s in all\n")
    print(markdown_table(["check", "case", "result", "ratio / MFU", "note"], rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "tiny": args.tiny, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
