"""FSDP2 (``train.parallel: fsdp``) and sharded checkpoints on the CPU: 2-process torchrun, gloo.

Design choices:

* The model, optimizers (Muon + AdamW), evaluation, samples and export are the LM recipe's; only
  the data order is changed (:class:`GlobalBatchLM`): micro-step ``m`` is rank ``r``'s slice of one
  global batch drawn from ``(seed, m)``, so 1 and 2 processes see the same tokens per step and
  their weights can be compared.
* This file is also the worker that torchrun starts (``python -m torch.distributed.run ...
  tests/test_fsdp.py OUT CACHE [--resume]``), so the tests need no separate script.
* Three torchrun launches in all: the uninterrupted 2-process run (module fixture), and in the
  slow test a run whose rank 1 is SIGKILLed after the first checkpoint plus its ``--resume``.
* Muon's Newton-Schulz runs in bf16, so two runs whose gradients differ by float rounding can round
  an element of the update differently; the 1-process comparison is after 2 steps (to 1e-5), the
  longer continuation on another world size is compared more loosely.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from _reliability_helpers import torchrun

pytestmark = pytest.mark.xdist_group("fsdp")  # module-scoped runs (test_fsdp_recipes.py shares `cache`), on one worker

STEPS = 12
CKPT_EVERY = 2
GLOBAL_BATCH = 4


def _overrides(cache: Path, parallel: str, steps: int = STEPS) -> list[str]:
    return [
        f"data.cache_dir={cache}",
        "data.vocab_size=400",
        "data.seq_len=32",
        f"data.batch_size={GLOBAL_BATCH}",
        # 3 evaluation batches of 4 x 32 tokens: one rank has a batch more (engine.fsdp.lockstep's fallback)
        "data.eval_tokens=384",
        "model.depth=2",
        "model.width=64",
        "model.n_heads=4",
        "model.laplacian_heads=2",
        "samples.max_new_tokens=2",
        'samples.prompts=["The"]',
        f"train.max_steps={steps}",
        "train.schedule=constant",
        "train.warmup_ratio=0",
        "train.eval_every=0",
        "train.log_every=1",
        f"train.ckpt_every={CKPT_EVERY}",
        "train.keep_checkpoints=0",
        "train.clip_grad=1.0",
        "train.progress=false",
        f"train.parallel={parallel}",
        "optim.muon_momentum_warmup=4",
        # small steps: Muon's Newton-Schulz runs in bf16, where a float-rounding difference of
        # the gradients can flip the last bit of an update element (lr x 2^-8 for 1-process vs
        # 2-process gradients); AdamW's eps 1e-10 similarly amplifies near-zero gradients
        "optim.matrix_lr=0.0001",
        "optim.embedding_lr=0.001",
        "optim.unembedding_lr=0.001",
    ]


def _build(cfg: Any, info: Any) -> Any:
    from lapheads.engine.data import _mix
    from lapheads.recipes import lm as R

    class GlobalBatchLM(R.LMTask):
        """The LM task with rank slices of one global batch per micro-step (see the module docstring).

        nanochat zeroes lm_head and the output projections, so the first updates of the block
        matrices come from low-rank gradients, and Muon's orthogonalisation blows their float
        rounding noise up to the size of the update; small random values make them full rank.
        """

        def __init__(self, *args: Any, **kw: Any):
            super().__init__(*args, **kw)
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if name.endswith(("o_proj.weight", "fc2.weight", "lm_head.weight")):
                        p.copy_(torch.randn(p.shape, generator=g) * 0.02)

        def batches(self, start_micro_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            d, world, rank = self.cfg.data, self.info.world_size, self.info.rank
            per = d.batch_size // world
            micro = start_micro_step
            while True:
                g = torch.Generator().manual_seed(_mix(self.cfg.train.seed, micro))
                x, y = self.train_shards.sample_batch(d.batch_size, d.seq_len, generator=g)
                yield x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
                micro += 1

    return GlobalBatchLM(cfg, info, run_dir=cfg._out)


def _config(out: Path, cache: Path, parallel: str, steps: int = STEPS) -> Any:
    from lapheads.engine.config import load_config
    from lapheads.recipes import lm as R

    cfg = load_config(R.LMConfig, None, _overrides(cache, parallel, steps))
    cfg._out = str(out)  # where the task writes samples.jsonl
    return cfg


def run(out: Path, cache: Path, parallel: str, resume: bool = False, steps: int = STEPS) -> dict:
    """Train (or resume) the tiny run in this process, under torchrun or alone."""
    from lapheads.engine.launch import launch

    return launch("lm", _config(out, cache, parallel, steps), _build, str(out), resume=resume)


# --------------------------------------------------------------------------- helpers of the tests
def _torchrun(out: Path, cache: Path, *extra: str) -> list[str]:
    return torchrun("--nproc_per_node=2", __file__, str(out), str(cache), *extra)


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", LAPHEADS_DIST_TIMEOUT="20")


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from lapheads.engine.checkpoint import load_tensors

    return load_tensors(path)


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


# Session scope and fixed paths under this worker's base temp: the xdist group "fsdp" interleaves
# this module's tests with test_fsdp_recipes.py's, and an xdist worker whose queue runs dry tears
# down even session fixtures; a re-created fixture finds its finished run on disk instead of
# training it again (one torchrun launch, ~20 s).
@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    """Tokenizer and token shards built once per worker for every run of the module."""
    from lapheads.recipes import lm as R

    root = tmp_path_factory.getbasetemp() / "fsdp_cache"
    root.mkdir(exist_ok=True)
    R.prepare_data(_config(root / "unused", root, "ddp").data)  # reuses shards already there
    return root


@pytest.fixture(scope="session")
def fsdp_run(cache, tmp_path_factory) -> Path:
    """The uninterrupted 2-process FSDP run (checkpoints every 2 steps, all kept)."""
    out = tmp_path_factory.getbasetemp() / "fsdp_run"
    if (out / "final" / "model.json").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    r = subprocess.run(_torchrun(out, cache), env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return out


# --------------------------------------------------------------------------- tests
def test_two_process_fsdp_equals_one_process(fsdp_run, cache, tmp_path):
    """2 FSDP ranks x 2 sequences give the weights and optimizer states of 1 process x 4 after 2 steps."""
    from lapheads.engine.fsdp import consolidate
    from lapheads.recipes import lm as R

    one = tmp_path / "one"
    run(one, cache, "ddp", steps=CKPT_EVERY)  # plain model, torch.optim.Muon
    ck = fsdp_run / "checkpoints" / f"step_{CKPT_EVERY:08d}"
    assert (ck / "dcp" / ".metadata").is_file() and (ck / "state.pt").is_file()
    full = consolidate(ck)
    _assert_close(_weights(one / "final" / "model.safetensors"), full["model"], atol=1e-5)
    # same losses and global gradient norms (FSDP's reduce-scatter and the sharded clipping)
    from lapheads.engine.run import RunDir

    logged = [
        [
            (r["loss"], r["grad_norm"])
            for r in RunDir(d).metrics()
            if r.get("split") != "val" and r["step"] <= CKPT_EVERY
        ]
        for d in (one, fsdp_run)
    ]
    assert len(logged[0]) == CKPT_EVERY
    torch.testing.assert_close(torch.tensor(logged[0]), torch.tensor(logged[1]), rtol=1e-5, atol=0)
    # the Muon momentum of every block matrix, gathered from the shards, equals the plain one
    from lapheads.engine.checkpoint import safe_torch_load

    plain = safe_torch_load(one / "checkpoints" / f"step_{CKPT_EVERY:08d}" / "state.pt")["optimizers"][1]
    bufs = [s["momentum_buffer"] for _, s in sorted(plain["state"].items())]
    sharded = [v["momentum_buffer"] for k, v in full["optim"]["state"].items() if "momentum_buffer" in v]
    assert len(bufs) == len(sharded) > 0
    assert {tuple(b.shape) for b in bufs} == {tuple(b.shape) for b in sharded}
    # torch's Muon on a DTensor differs from one process; ShardedMuon does not (same gradient)
    muon = json.loads((fsdp_run.parent / "muon_check.json").read_text())
    assert muon["sharded_muon"] == 0.0, muon
    # the finished run: one pointer, every checkpoint complete, the usual single-file export
    ckd = fsdp_run / "checkpoints"
    assert (ckd / "latest").read_text().strip() == f"step_{STEPS:08d}"
    assert not list(ckd.glob(".tmp-*"))
    assert len(list(ckd.glob("step_*"))) == STEPS // CKPT_EVERY
    model, tok = R.load_model(fsdp_run)
    assert model.config.laplacian_heads == 2
    _assert_close(
        {k: v for k, v in model.state_dict().items() if k in _weights(fsdp_run / "final" / "model.safetensors")},
        _weights(fsdp_run / "final" / "model.safetensors"),
        atol=0,
    )
    # the final evaluation (3 batches over 2 ranks, one a fallback) equals one process's over the same 12 windows
    import numpy as np
    import torch.nn.functional as F

    from lapheads.data.shards import TokenShards

    val = TokenShards(R.prepare_data(_config(fsdp_run, cache, "ddp").data)[1], "val")
    w = torch.from_numpy(np.stack([val.tokens(j * 32, 33) for j in range(12)]))
    with torch.no_grad():
        nats = F.cross_entropy(model(w[:, :-1]).logits.float().transpose(1, 2), w[:, 1:])
    final = json.loads((fsdp_run / "final" / "metrics.json").read_text())
    assert final["val_tokens"] == 12 * 32
    assert final["val_loss"] == pytest.approx(float(nats), rel=1e-5)
    samples = [json.loads(line) for line in (fsdp_run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [STEPS]  # written once, by rank 0
    meta = json.loads((fsdp_run / "meta.json").read_text())
    assert meta["starts"][0]["world_size"] == 2


def _rewound_copy(run: Path, dst: Path, step: int) -> Path:
    """A copy of a finished run as if it had stopped after the checkpoint of ``step`` (later ones and
    ``final/`` removed): what ``--resume`` then continues."""
    shutil.copytree(run, dst)
    ckd = dst / "checkpoints"
    for p in ckd.glob("step_*"):
        if p.name != f"step_{step:08d}":
            shutil.rmtree(p)
    (ckd / "latest").write_text(f"step_{step:08d}")
    shutil.rmtree(dst / "final")
    return dst


def test_sharded_checkpoint_resumes_on_one_process(fsdp_run, cache, tmp_path):
    """A checkpoint of 2 FSDP ranks loads into 1 process exactly (re-sharded) and training continues."""
    from lapheads.engine import dist as D
    from lapheads.engine.fsdp import consolidate
    from lapheads.engine.run import RunDir
    from lapheads.engine.trainer import Trainer

    run_dir = _rewound_copy(fsdp_run, tmp_path / "run", CKPT_EVERY)
    ckd = run_dir / "checkpoints"
    # the resumed state is the checkpoint's, tensor for tensor
    cfg = _config(run_dir, cache, "fsdp")
    trainer = Trainer(_build(cfg, D.DistInfo()), cfg.train, RunDir(run_dir))
    trainer.restore()
    full = consolidate(ckd / f"step_{CKPT_EVERY:08d}")
    assert trainer.step == CKPT_EVERY
    _assert_close(trainer.model.state_dict(), full["model"], atol=0)
    muon = trainer.optims[1]
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for p, st in muon.state.items():
        torch.testing.assert_close(
            st["momentum_buffer"], full["optim"]["state"][names[id(p)]]["momentum_buffer"], rtol=0, atol=0
        )
    # continuing with one process reaches the end near the uninterrupted 2-process run
    res = run(run_dir, cache, "fsdp", resume=True)
    assert res["val_bpb"] > 0
    steps = [r["step"] for r in RunDir(run_dir).metrics() if "loss" in r and r.get("split") != "val"]
    assert steps == list(range(1, STEPS + 1))
    _assert_close(
        _weights(run_dir / "final" / "model.safetensors"), _weights(fsdp_run / "final" / "model.safetensors"), atol=2e-3
    )
    assert json.loads((run_dir / "meta.json").read_text())["starts"][-1]["world_size"] == 1


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank's process in /proc")
def test_killed_rank_then_resume_equals_uninterrupted(fsdp_run, cache, tmp_path):
    """SIGKILL of rank 1 after the first checkpoint; ``--resume`` ends with the uninterrupted run's weights."""
    from test_distributed_faults import _worker_of_rank

    out = tmp_path / "killed"
    proc = subprocess.Popen(
        _torchrun(out, cache), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    killed = False
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "checkpoints" / "latest").is_file():
                pid = _worker_of_rank(proc.pid, 1)
                if pid is not None:
                    os.kill(pid, 9)
                    killed = True
                    break
            time.sleep(0.02)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert killed, "the run ended before rank 1 could be killed"
    assert proc.returncode != 0, err[-2000:]
    assert not (out / "final").exists()
    ck = (out / "checkpoints" / "latest").read_text().strip()
    assert int(ck.split("_")[1]) < STEPS
    r = subprocess.run(_torchrun(out, cache, "--resume"), env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    _assert_close(
        _weights(out / "final" / "model.safetensors"), _weights(fsdp_run / "final" / "model.safetensors"), atol=0
    )
    assert not list((out / "checkpoints").glob(".tmp-*"))


def muon_check(out: Path) -> None:
    """Under torchrun: one Muon step on a row-sharded matrix vs one process, written to ``out``.

    Every rank holds the same full gradient, so any difference comes from the optimizer alone:
    ShardedMuon must equal torch's Muon on the full matrix exactly; torch's Muon applied to the
    DTensor directly is recorded too (it orthogonalises through DTensor ops with partial sums).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lapheads.engine.fsdp import ShardedMuon

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    w0, grad = torch.randn(48, 32, generator=g), torch.randn(48, 32, generator=g)
    results = {}
    for name, cls, sharded in (
        ("plain", torch.optim.Muon, False),
        ("sharded_muon", ShardedMuon, True),
        ("torch_muon_on_dtensor", torch.optim.Muon, True),
    ):
        p = torch.nn.Parameter(distribute_tensor(w0.clone(), mesh, [Shard(0)]) if sharded else w0.clone())
        opt = cls([p], lr=0.02, adjust_lr_fn="original")
        for _ in range(2):
            p.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)]) if sharded else grad.clone()
            opt.step()
        results[name] = (p.full_tensor() if sharded else p).detach()
    if dist.get_rank() == 0:
        out.write_text(json.dumps({k: float((v - results["plain"]).abs().max()) for k, v in results.items()}))


def test_fsdp_refused_where_unsupported(tmp_path):
    """A recipe without FSDP blocks, and an EMA under FSDP, are one-line config errors."""
    from lapheads.engine.run import RunDir
    from lapheads.engine.trainer import Task, TrainConfig, Trainer
    from lapheads.errors import ConfigError

    class Tiny(Task):
        name = "tiny"
        model = torch.nn.Linear(2, 2)

        def optimizers(self) -> list[torch.optim.Optimizer]:
            return [torch.optim.SGD(self.model.parameters(), lr=0.1)]

    with pytest.raises(ConfigError, match="train.parallel=fsdp is not supported by the tiny recipe"):
        Trainer(Tiny(), TrainConfig(max_steps=1, parallel="fsdp"), RunDir(tmp_path / "run"))
    with pytest.raises(ConfigError, match="ema_decay"):
        TrainConfig(max_steps=1, parallel="fsdp", ema_decay=0.9).validate()
    TrainConfig(max_steps=1, parallel="fsdp").validate()


if __name__ == "__main__":  # the torchrun worker: OUT CACHE [--resume]
    import torch.distributed as dist

    dist.init_process_group("gloo")  # launch() takes this group over (and ends it)
    if "--resume" not in sys.argv:
        muon_check(Path(sys.argv[1]).parent / "muon_check.json")
    run(Path(sys.argv[1]), Path(sys.argv[2]), "fsdp", resume="--resume" in sys.argv[3:])
    from lapheads.cli import _spare_the_exit_collections

    _spare_the_exit_collections()  # as the console does: exit without the shutdown collections
