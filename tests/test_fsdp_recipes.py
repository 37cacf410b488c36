"""FSDP2 for the SFT and retrofit recipes, activation checkpointing, and resume on another world size.

One torchrun (2 processes, gloo, ``train.parallel=fsdp``) trains three tiny runs from one
"pretrained" save_pretrained directory (2 layers, width 32, k = 0): an SFT run, a retrofit run
(``data.total_batch_tokens`` set, a checkpoint every 2 steps), and the same retrofit run with
``train.activation_checkpointing``. One torchrun start costs most of the time, so the runs share it.

Each is compared with one process, through the recipe's own ``train`` (what ``lapheads train``
calls). What makes the numbers comparable (``_Interleaved``):

* The recipes draw each rank's micro-batches from its own stream, seeded by (seed, rank, micro
  step). The test tasks draw micro-batch ``m`` of rank ``r`` from the single-process stream at
  ``m * world + r``, so 2 ranks x ``grad_accum`` 1 see, in one optimizer step, what 1 process sees
  with ``grad_accum`` 2. The loss of a micro-batch is the recipe's (SFT: mean over its assistant
  tokens), and FSDP averages the ranks' gradients as accumulation averages the micro-batches, so
  the updates agree to float rounding.
* For retrofit ``data.total_batch_tokens`` is set and ``train.grad_accum`` is derived from the
  world size (1 with 2 processes, 2 with one): literally the same config on both sides. The
  checkpoint the 2-process run wrote at step 2 is then resumed by one process, which recomputes
  ``grad_accum`` (the optimizer batch in tokens stays the same) and ends where the uninterrupted
  2-process run ends.
* The "pretrained" model has no zero-initialised matrices (nanochat zeroes ``o_proj``, ``fc2`` and
  ``lm_head``): SFT's Muon would otherwise orthogonalise low-rank gradients, which blows float
  rounding up to the size of the update (see test_fsdp.py).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch
import yaml
from _reliability_helpers import torchrun
from test_fsdp import (
    _assert_close,
    _env,
    _rewound_copy,
    _weights,
    cache,  # noqa: F401  (the session-scoped tokenizer + shards fixture, shared)
)

pytestmark = pytest.mark.xdist_group("fsdp")  # module-scoped runs, on one worker

STEPS = 4
CKPT_EVERY = 2
PER_RANK = 2  # sequences per process and micro-step
SFT_SEQ, RETRO_SEQ = 64, 32
TOTAL_TOKENS = 2 * PER_RANK * RETRO_SEQ  # grad_accum 1 on 2 processes, 2 on one


# --------------------------------------------------------------------------- tasks and recipes of the tests
class _Interleaved:
    """Micro-batch ``m`` of rank ``r`` is the recipe's single-process micro-batch ``m * world + r``."""

    info: Any

    def batches(self, start_micro_step: int) -> Iterator[Any]:
        world, rank = self.info.world_size, self.info.rank
        one = copy.copy(self)  # the recipe's stream as rank 0 of one process draws it
        one.info = dataclasses.replace(self.info, rank=0, world_size=1)
        return itertools.islice(
            super(_Interleaved, one).batches(start_micro_step * world + rank),  # type: ignore[misc]
            0,
            None,
            world,
        )


def _sft_recipe() -> Any:
    from lapheads.recipes import sft as S

    class Task(_Interleaved, S.SFTTask):
        pass

    class Recipe(S.SFTRecipe):
        def build_task(self, cfg: Any, info: Any, run_dir: Optional[str | Path] = None) -> Any:
            return Task(cfg, info)

    return Recipe()


def _retrofit_recipe() -> Any:
    from lapheads.recipes import retrofit as RF

    class Task(_Interleaved, RF.RetrofitTask):
        """Counts the training-time calls of the first decoder layer's MLP: twice per micro-step when
        activation checkpointing recomputes the layer in backward. (transformers checkpoints the layer's
        ``forward``, so hooks on the layer itself, FSDP's included, run once; torch stops the recompute
        once it has the saved tensors, so the MLP's post-forward hook runs once too: a pre-hook counts.)"""

        layer_calls = 0

        def __init__(self, *args: Any, **kw: Any):
            super().__init__(*args, **kw)
            Task.layer_calls = 0

            def count(module: Any, args: Any) -> None:
                if torch.is_grad_enabled():  # not the evaluations (no_grad)
                    Task.layer_calls += 1

            self.model.model.layers[0].mlp.register_forward_pre_hook(count)

    class Recipe(RF.RetrofitRecipe):
        task = Task

        def build_task(self, cfg: Any, info: Any, run_dir: Optional[str | Path] = None) -> Any:
            return Task(cfg, info, run_dir=run_dir)

    return Recipe()


def _sft_config(pretrained: Path, world: int) -> Any:
    from lapheads.engine.config import load_config
    from lapheads.recipes import sft as S

    return load_config(
        S.SFTConfig,
        None,
        [
            f"init_from={pretrained}",
            f"data.seq_len={SFT_SEQ}",
            f"data.batch_size={PER_RANK}",
            "data.max_eval_items=4",
            f"train.grad_accum={2 // world}",
            f"train.max_steps={STEPS}",
            "train.eval_every=0",
            "train.log_every=1",
            "train.progress=false",
            f"train.parallel={'fsdp' if world > 1 else 'ddp'}",
        ],
    )


def _retrofit_config(pretrained: Path, cache_dir: Path, parallel: str, *extra: str) -> Any:
    from lapheads.engine.config import load_config
    from lapheads.recipes import retrofit as RF

    return load_config(
        RF.RetrofitConfig,
        None,
        [
            f"init_from={pretrained}",
            f"data.cache_dir={cache_dir}",
            "laplacian_heads=1",
            "baseline=false",
            f"data.seq_len={RETRO_SEQ}",
            f"data.batch_size={PER_RANK}",
            f"data.total_batch_tokens={TOTAL_TOKENS}",
            "data.eval_tokens=128",
            f"train.max_steps={STEPS}",
            "train.warmup_ratio=0",
            "train.log_every=1",
            f"train.ckpt_every={CKPT_EVERY}",
            "train.keep_checkpoints=0",
            "train.progress=false",
            f"train.parallel={parallel}",
            *extra,
        ],
    )


def _losses(run: Path) -> list[tuple[float, float]]:
    from lapheads.engine.run import RunDir

    return [(r["loss"], r["grad_norm"]) for r in RunDir(run).metrics() if "loss" in r and r.get("split") != "val"]


def _check_same_run(one: Path, two: Path, start: Path) -> None:
    """Same logged losses and gradient norms, and the same final weights, to 1e-5; weights that moved
    from ``start`` (the pretrained model) by far more than that, so the comparison can fail."""
    a, b = _losses(one), _losses(two)
    assert len(a) == len(b) == STEPS
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=0)
    final = _weights(one / "final" / "model.safetensors")
    _assert_close(final, _weights(two / "final" / "model.safetensors"), atol=1e-5)
    begin = _weights(start / "model.safetensors")
    assert max(float((final[k] - begin[k]).abs().max()) for k in final) > 1e-4


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def pretrained(cache, tmp_path_factory) -> Path:  # noqa: F811  (cache: the fixture imported above)
    """A save_pretrained directory: a 2-layer, 32-wide NanoChat LM (k = 0) with random weights everywhere."""
    from lapheads.engine.config import load_config
    from lapheads.engine.dist import DistInfo
    from lapheads.recipes import lm as R

    cfg = load_config(
        R.LMConfig,
        None,
        [
            f"data.cache_dir={cache}",
            "data.vocab_size=400",
            f"data.seq_len={SFT_SEQ}",
            "model.depth=2",
            "model.width=32",
            "model.n_heads=2",
            "model.laplacian_heads=0",
            "train.progress=false",
        ],
    )
    task = R.LMTask(cfg, DistInfo())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in task.model.named_parameters():
            if name.endswith(("o_proj.weight", "fc2.weight", "lm_head.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    out = tmp_path_factory.mktemp("fsdp_recipes") / "pretrained"
    R.export_hf(task.model, task.tokenizer, out)
    # the retrofit shards (tokenized with this model's tokenizer) are built once, here
    R.prepare_data(_retrofit_config(out, cache, "ddp").data)
    return out


@pytest.fixture(scope="module")
def two_process(pretrained, cache, tmp_path_factory) -> Path:  # noqa: F811
    """The three 2-process FSDP runs (sft, retro, retro_ac) of one torchrun."""
    out = tmp_path_factory.mktemp("fsdp_recipes_2p")
    cmd = torchrun("--nproc_per_node=2", __file__, str(out), str(cache), str(pretrained))
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def retro_one(pretrained, cache, tmp_path_factory) -> Path:  # noqa: F811
    """The retrofit run in one process (grad_accum derived: 2)."""
    out = tmp_path_factory.mktemp("fsdp_recipes_1p") / "retro"
    cfg = _retrofit_config(pretrained, cache, "ddp")
    assert cfg.train.grad_accum == 2
    _retrofit_recipe().train(cfg, out)
    return out


# --------------------------------------------------------------------------- tests
def test_sft_two_process_fsdp_equals_one_process(two_process, pretrained, tmp_path):
    """``lapheads train sft --set train.parallel=fsdp`` on 2 ranks = 1 process with the same global batch."""
    from lapheads.recipes.lm import load_model

    one = tmp_path / "sft"
    _sft_recipe().train(_sft_config(pretrained, 1), one)
    two = two_process / "sft"
    _check_same_run(one, two, pretrained)
    assert json.loads((two / "meta.json").read_text())["starts"][0]["world_size"] == 2
    assert (two / "checkpoints" / f"step_{STEPS:08d}" / "dcp" / ".metadata").is_file()
    model, _ = load_model(two)  # final/hf reads like any SFT run's
    assert model.config.laplacian_heads == 0
    assert json.loads((two / "final" / "metrics.json").read_text())["val_loss"] > 0


def test_retrofit_two_process_fsdp_equals_one_process(two_process, retro_one, pretrained):
    """``lapheads train retrofit --set train.parallel=fsdp`` on 2 ranks = 1 process, same config."""
    two = two_process / "retro"
    _check_same_run(retro_one, two, pretrained)
    assert yaml.safe_load((two / "config.yaml").read_text())["train"]["grad_accum"] == 1
    summary = json.loads((two / "retrofit.json").read_text())
    assert summary["laplacian_heads"] == 1 and summary["original_laplacian_heads"] == 0
    assert summary["metrics"]["after_steps"]["val_loss"] > 0
    hf = json.loads((two / "final" / "hf" / "config.json").read_text())
    assert hf["laplacian_heads"] == 1


def test_activation_checkpointing_changes_nothing(two_process, retro_one, pretrained, cache, tmp_path):  # noqa: F811
    """``train.activation_checkpointing``: same losses and weights, with FSDP (2 ranks) and without (1 process);
    the first layer's MLP runs twice per micro-step (forward, recompute in backward) instead of once."""
    _check_same_run(two_process / "retro", two_process / "retro_ac", pretrained)
    recipe = _retrofit_recipe()
    calls = json.loads((two_process / "layer_calls.json").read_text())
    assert calls == {"retro": STEPS, "retro_ac": 2 * STEPS}  # per rank: grad_accum 1
    ac = tmp_path / "retro_ac"
    cfg = _retrofit_config(pretrained, cache, "ddp", "train.activation_checkpointing=true")
    recipe.train(cfg, ac)
    assert recipe.task.layer_calls == 2 * 2 * STEPS  # grad_accum 2
    _check_same_run(retro_one, ac, pretrained)


def test_two_process_checkpoint_resumes_on_one_process(two_process, retro_one, pretrained, cache, tmp_path):  # noqa: F811
    """With ``data.total_batch_tokens`` the 2-process checkpoint of step 2 resumes in 1 process: grad_accum
    is recomputed (1 -> 2), the optimizer batch stays 128 tokens, and the run ends with the weights of the
    uninterrupted 2-process run."""
    from lapheads.engine.run import RunDir
    from lapheads.errors import ConfigError
    from lapheads.recipes.lm import resolve_grad_accum

    run = _rewound_copy(two_process / "retro", tmp_path / "retro", CKPT_EVERY)
    cfg = _retrofit_config(pretrained, cache, "fsdp")
    assert cfg.train.grad_accum == 2
    _retrofit_recipe().train(cfg, run, resume=True)
    steps = [r["step"] for r in RunDir(run).metrics() if "loss" in r and r.get("split") != "val"]
    assert steps == list(range(1, STEPS + 1))
    _assert_close(
        _weights(run / "final" / "model.safetensors"),
        _weights(two_process / "retro" / "final" / "model.safetensors"),
        atol=1e-5,
    )
    torch.testing.assert_close(torch.tensor(_losses(run)), torch.tensor(_losses(retro_one)), rtol=1e-5, atol=0)
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["grad_accum"] == 2
    assert [s["world_size"] for s in json.loads((run / "meta.json").read_text())["starts"]] == [2, 1]
    # a world size whose micro-step does not divide the optimizer batch cannot keep it: one line, the key
    with pytest.raises(ConfigError) as e:
        resolve_grad_accum(copy.deepcopy(cfg.data), copy.deepcopy(cfg.train), 3)
    assert "data.total_batch_tokens=128" in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------- the shipped tiny LM, as the CLI runs it
TINY_STEPS, TINY_CKPT = 6, 3


def _tiny_lm_cmd(out: Path, *extra: str) -> list[str]:
    """``torchrun --nproc_per_node=2 -m lapheads.cli train lm --config .../tiny.yaml --out OUT --set ...``."""
    from lapheads.recipes.shipped import CONFIG_DIR

    sets = ["train.parallel=fsdp", f"train.max_steps={TINY_STEPS}", f"train.ckpt_every={TINY_CKPT}"]
    sets += ["train.eval_every=0", "train.progress=false"]
    args = ["train", "lm", "--config", str(CONFIG_DIR / "lm" / "tiny.yaml"), "--out", str(out)]
    return torchrun(
        "--nproc_per_node=2", "-m", "lapheads.cli", *args, *itertools.chain(*(("--set", s) for s in sets)), *extra
    )


def _run_cli(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    from _reliability_helpers import subprocess_env

    # a collective left waiting by another rank fails within 20 s instead of gloo's default 30 min
    return subprocess.run(
        cmd, env=subprocess_env(LAPHEADS_DIST_TIMEOUT="20", **env), capture_output=True, text=True, timeout=300
    )


_REF_LAPLACIAN: dict[str, int] = {"k": 0}  # trailing Laplacian heads of the reference attention below


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Softmax attention written out (scores, mask, softmax, weighted sum), then ``V - PV`` on the trailing k heads."""
    h, tq, tk = query.shape[1], query.shape[2], key.shape[2]
    key, value = key.repeat_interleave(h // key.shape[1], 1), value.repeat_interleave(h // value.shape[1], 1)
    scores = query @ key.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    scores = scores.masked_fill(torch.ones(tq, tk, dtype=torch.bool).triu(tk - tq + 1), float("-inf"))
    if attention_mask is not None:  # none without padding; kept general
        bool_mask = attention_mask.dtype == torch.bool
        scores = scores.masked_fill(~attention_mask, float("-inf")) if bool_mask else scores + attention_mask
    p = torch.softmax(scores, dim=-1)
    out = p @ value
    k = _REF_LAPLACIAN["k"]
    if k:
        out = torch.cat([out[:, : h - k], value[:, h - k :, tk - tq :] - out[:, h - k :]], dim=1)
    return out.transpose(1, 2).contiguous(), p


@pytest.mark.slow
def test_tiny_lm_cli_two_process_fsdp_resume_and_export(tmp_path):
    """The shipped tiny LM (``recipes/configs/lm/tiny.yaml``) under ``torchrun --nproc_per_node=2 -m lapheads.cli
    train lm ... --set train.parallel=fsdp``, 6 steps, checkpoints at 3 and 6; the same command crashing after
    step 4 then ``--resume``-d from step 3 ends with the same weights and metrics. The final evaluation is
    recomputed in one process from the exported model and the validation windows; the exported model keeps
    its 2 Laplacian heads per layer (logits = an attention written out here).

    The validation windows of this config make an odd number of evaluation batches, so one rank runs a
    forward more than the other (lockstep's fallback batch): the sharded evaluation must agree on the count
    before any forward, and drop the fallback from the sums."""
    import math

    import numpy as np
    import torch.nn.functional as F
    from _reliability_helpers import same_weights
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from lapheads.data.shards import TokenShards
    from lapheads.engine.checkpoint import latest_checkpoint
    from lapheads.recipes import lm as R
    from lapheads.testing import CRASH_AFTER

    ref, run = tmp_path / "ref", tmp_path / "run"
    r = _run_cli(_tiny_lm_cmd(ref))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert [p.name for p in sorted((ref / "checkpoints").glob("step_*"))] == ["step_00000003", "step_00000006"]
    assert latest_checkpoint(ref / "checkpoints").name == "step_00000006"
    # the same command, crashing after step 4 (before any checkpoint of it), then resumed from step 3
    r = _run_cli(_tiny_lm_cmd(run), **{CRASH_AFTER: "4"})
    assert r.returncode != 0 and "simulated crash after step 4" in r.stderr, r.stderr[-4000:]
    assert latest_checkpoint(run / "checkpoints").name == "step_00000003" and not (run / "final").exists()
    r = _run_cli(_tiny_lm_cmd(run, "--resume"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "resuming" in r.stdout + r.stderr and "from step 3" in r.stdout + r.stderr
    assert same_weights(ref / "final" / "model.safetensors", run / "final" / "model.safetensors")
    assert same_weights(ref / "final" / "hf" / "model.safetensors", run / "final" / "hf" / "model.safetensors")
    final = json.loads((ref / "final" / "metrics.json").read_text())
    assert json.loads((run / "final" / "metrics.json").read_text()) == final
    assert [s["world_size"] for s in json.loads((run / "meta.json").read_text())["starts"]] == [2, 2]

    # the final evaluation again, in this process: every validation window of the config, no ranks
    cfg = R.LMRecipe().read_config(ref)
    tok, shard_dir = R.prepare_data(cfg.data)  # the session cache the runs built
    val, seq, bs = TokenShards(shard_dir, "val"), cfg.data.seq_len, cfg.data.eval_batch_size or cfg.data.batch_size
    n_windows = min((val.num_tokens - 1) // seq, bs * max(1, cfg.data.eval_tokens // (bs * seq)))
    assert math.ceil(n_windows / bs) % 2 == 1  # the 2 ranks get different numbers of batches
    windows = torch.from_numpy(np.stack([val.tokens(j * seq, seq + 1) for j in range(n_windows)]))
    x, y = windows[:, :-1], windows[:, 1:]
    model, tok = R.load_model(ref)  # final/hf, the documented loader of LM runs
    assert model.config.laplacian_heads == 2 and model.config._attn_implementation == "laplacian_sdpa"
    with torch.no_grad():
        nats = torch.cat(
            [
                F.cross_entropy(model(xb).logits.float().transpose(1, 2), yb, reduction="none").flatten()
                for xb, yb in zip(x.split(bs), y.split(bs))
            ]
        )
    nbytes = R.token_bytes(tok)[y.flatten()]
    assert final["val_tokens"] == y.numel() == n_windows * seq
    assert final["val_loss"] == pytest.approx(float(nats.double().mean()), rel=1e-5)
    bpb = float((nats.double() * (nbytes > 0)).sum()) / (math.log(2) * int(nbytes.sum()))
    assert final["val_bpb"] == pytest.approx(bpb, rel=1e-5)

    # the exported model's logits are those of the written-out attention with the 2 trailing heads Laplacian
    model = model.double()
    with torch.no_grad():
        got = model(x[:2]).logits
        AttentionInterface.register("test_fsdp_tiny_reference", _reference_attention)
        AttentionMaskInterface.register("test_fsdp_tiny_reference", sdpa_mask)
        model.set_attn_implementation("test_fsdp_tiny_reference")
        _REF_LAPLACIAN["k"] = 2
        want = model(x[:2]).logits
        _REF_LAPLACIAN["k"] = 0
        standard = model(x[:2]).logits
    torch.testing.assert_close(got, want, atol=1e-9, rtol=0)
    assert float((got - standard).abs().max()) > 1e-2  # the heads change the output: the check above can fail


if __name__ == "__main__":  # the torchrun worker: OUT CACHE PRETRAINED
    out, cache_dir, pre = (Path(a) for a in sys.argv[1:4])
    _sft_recipe().train(_sft_config(pre, 2), out / "sft")
    calls = {}
    for name, extra in (("retro", ()), ("retro_ac", ("train.activation_checkpointing=true",))):
        recipe = _retrofit_recipe()
        recipe.train(_retrofit_config(pre, cache_dir, "fsdp", *extra), out / name)
        calls[name] = recipe.task.layer_calls
    if int(os.environ["RANK"]) == 0:
        (out / "layer_calls.json").write_text(json.dumps(calls))
    from lapheads.cli import _spare_the_exit_collections

    _spare_the_exit_collections()  # as the console does: exit without the shutdown collections
