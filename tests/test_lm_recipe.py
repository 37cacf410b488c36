"""NanoChat model, optimizers and the `train lm` recipe on the embedded corpus (tiny shapes)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lapheads.engine import RunDir
from lapheads.engine.checkpoint import latest_checkpoint, load_tensors
from lapheads.engine.config import load_config
from lapheads.engine.launch import launch
from lapheads.errors import CheckpointError, ConfigError, DataError
from lapheads.lm.model import (
    LMModelConfig,
    LMOptimConfig,
    budget_steps,
    build_model,
    build_optimizers,
    count_params,
    muon_momentum,
    param_groups,
    resolve_shape,
)
from lapheads.recipes import lm as R
from lapheads.recipes.shipped import CONFIG_DIR


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One tokenizer + shard build of the embedded corpus shared by the tests of this module."""
    return str(tmp_path_factory.mktemp("lmcache"))


def _cfg(cache, *overrides):
    base = [
        f"data.cache_dir={cache}",
        "data.vocab_size=512",
        "data.seq_len=64",
        "data.batch_size=8",
        "data.eval_tokens=4096",
        "model.depth=2",
        "model.width=64",
        "model.n_heads=4",
        "model.laplacian_heads=2",
        "samples.max_new_tokens=4",
        "samples.prompts=[The list]",
        "train.max_steps=8",
        "train.progress=false",
        "train.log_every=1",
        "train.eval_every=4",
        "train.warmup_steps=2",
        "optim.muon_momentum_warmup=4",
    ]
    return load_config(R.LMConfig, None, base + list(overrides))


# ----------------------------------------------------------------------------- model
def test_d20_shape_and_budget_match_nanochat():
    s = resolve_shape(LMModelConfig(depth=20))
    assert (s["width"], s["n_heads"], s["head_dim"], s["intermediate"]) == (1280, 10, 128, 5120)
    with torch.device("meta"):
        m = build_model(LMModelConfig(depth=20, laplacian_heads=5), 65536, 2048, init=False)
    c = m.config
    assert (c.hidden_act, c.final_logit_softcapping, c.tie_word_embeddings, c.rope_parameters["rope_theta"]) == (
        "relu2",
        15.0,
        False,
        10000.0,
    )
    n = count_params(m)
    assert n == 20 * 12 * 1280**2 + 2 * 65536 * 1280  # 560,988,160: the paper's "561M"
    assert budget_steps(n, 20, 524288) == 21400  # nanochat's d20 run length
    assert m.config.laplacian_heads == 5


def test_shape_errors():
    with pytest.raises(ConfigError, match="not divisible"):
        resolve_shape(LMModelConfig(depth=2, width=100, n_heads=3))
    with pytest.raises(ConfigError, match="laplacian_heads"):
        build_model(LMModelConfig(depth=2, width=64, n_heads=4, laplacian_heads=5), 300, 32)
    with pytest.raises(ConfigError, match="vocab"):
        build_model(LMModelConfig(depth=2, width=64, n_heads=4, vocab_size=1000), 300, 32)


def test_zero_init_makes_laplacian_heads_a_noop_at_step0():
    torch.manual_seed(0)
    a = build_model(LMModelConfig(depth=2, width=64, n_heads=4, laplacian_heads=0), 300, 32)
    b = build_model(LMModelConfig(depth=2, width=64, n_heads=4, laplacian_heads="all"), 300, 32)
    b.load_state_dict(a.state_dict())
    for layer in a.model.layers:
        assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.fc2.weight.any()
    assert not a.lm_head.weight.any()
    # make lm_head non-zero so the logits depend on the hidden states
    with torch.no_grad():
        w = torch.randn_like(a.lm_head.weight)
        a.lm_head.weight.copy_(w)
        b.lm_head.weight.copy_(w)
    x = torch.randint(0, 300, (2, 16))
    assert torch.equal(a(x).logits, b(x).logits)
    # ... and it is not a no-op once o_proj is trained
    with torch.no_grad():
        for la, lb in zip(a.model.layers, b.model.layers):
            r = torch.randn_like(la.self_attn.o_proj.weight)
            la.self_attn.o_proj.weight.copy_(r)
            lb.self_attn.o_proj.weight.copy_(r)
    assert not torch.allclose(a(x).logits, b(x).logits)


def test_optimizer_groups():
    m = build_model(LMModelConfig(depth=3, width=128, n_heads=2), 300, 32)
    g = param_groups(m)
    ids = [id(p) for ps in g.values() for _, p in ps]
    assert len(ids) == len(set(ids)) == len(list(m.parameters()))
    assert all(n.startswith("model.layers.") and p.ndim == 2 for n, p in g["matrix"])
    assert [n for n, _ in g["embedding"]] == ["model.embed_tokens.weight"]
    assert [n for n, _ in g["lm_head"]] == ["lm_head.weight"]
    adamw, muon = build_optimizers(m, LMOptimConfig())
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert {id(p) for p in muon.param_groups[0]["params"]} == {id(p) for _, p in g["matrix"]}
    scale = (128 / 768) ** -0.5
    lrs = {gr["name"]: gr["lr"] for gr in adamw.param_groups}
    assert lrs["lm_head"] == pytest.approx(0.004 * scale) and lrs["embedding"] == pytest.approx(0.2 * scale)
    assert muon.param_groups[0]["lr"] == 0.02 and muon.param_groups[0]["weight_decay"] == 0.0
    o = LMOptimConfig()
    assert muon_momentum(0, o) == 0.85 and muon_momentum(150, o) == pytest.approx(0.9) and muon_momentum(900, o) == 0.95


def test_grad_accum_from_total_batch_tokens():
    cfg = load_config(R.LMConfig, None, ["data.seq_len=64", "data.batch_size=8", "data.total_batch_tokens=2048"])
    assert cfg.train.grad_accum == 4
    with pytest.raises(ConfigError, match="multiple"):
        load_config(R.LMConfig, None, ["data.seq_len=64", "data.batch_size=8", "data.total_batch_tokens=1000"])
    with pytest.raises(ConfigError, match="contradicts"):
        load_config(
            R.LMConfig,
            None,
            ["data.seq_len=64", "data.batch_size=8", "data.total_batch_tokens=2048", "train.grad_accum=3"],
        )


# ----------------------------------------------------------------------------- recipe
def test_token_bytes_count_utf8(cache):
    tok, _ = R.prepare_data(_cfg(cache).data)
    tb = R.token_bytes(tok)
    text = "Ünïcode → naïve café, 数字 1234 and plain ASCII."
    ids = tok.encode(text, add_special_tokens=True)  # BOS first: a special token, 0 bytes
    assert int(tb[ids].sum()) == len(text.encode("utf-8"))
    assert tb[tok.bos_token_id] == 0


def test_tiny_lm_trains_and_exports(cache, tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(cache, "train.max_steps=30", "train.eval_every=10", "data.batch_size=16")
    task_holder = {}

    def build(c, info):
        task_holder["t"] = R.LMTask(c, info, run_dir=out)
        return task_holder["t"]

    launch("lm", cfg, build, str(out))
    task = task_holder["t"]
    vals = [r for r in RunDir(out).metrics() if r.get("split") == "val"]
    assert [r["step"] for r in vals] == [10, 20, 30]
    # zero lm_head at step 0: loss ln(V) per token, i.e. ln(V)/ln2 bits spread over the bytes
    init_bpb = math.log(len(task.tokenizer)) / math.log(2) / task.val_shards.bytes_per_token
    assert vals[-1]["val_bpb"] < vals[0]["val_bpb"] < init_bpb
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {10, 20, 30} and all(s["prompt"] == "The list" for s in samples)
    # final/hf loads with transformers and keeps the Laplacian heads and the weights
    model, tok = R.load_model(out)
    assert model.config.laplacian_heads == 2 and model.config._attn_implementation == "laplacian_sdpa"
    x = torch.randint(0, len(tok), (2, 32))
    with torch.no_grad():
        assert torch.allclose(model(x).logits, task.model.eval()(x).logits, atol=1e-5)
        bpb = task.val_bpb(model)["val_bpb"]
    assert bpb == pytest.approx(vals[-1]["val_bpb"], rel=1e-5)


class _Crash(RuntimeError):
    pass


def test_lm_exact_resume_after_crash(cache, tmp_path):
    cfg = _cfg(cache, "train.ckpt_every=3", "data.total_batch_tokens=1024")  # grad_accum 2
    ref = tmp_path / "ref"
    launch("lm", cfg, lambda c, i: R.LMTask(c, i), str(ref))

    class CrashTask(R.LMTask):
        def after_optimizer_step(self, step, total):
            if step == 4:
                raise _Crash("simulated crash after step 5")

    crashed = tmp_path / "crashed"
    with pytest.raises(_Crash):
        launch(
            "lm",
            _cfg(cache, "train.ckpt_every=3", "data.total_batch_tokens=1024"),
            lambda c, i: CrashTask(c, i),
            str(crashed),
        )
    assert latest_checkpoint(crashed / "checkpoints").name == "step_00000003"
    launch(
        "lm",
        _cfg(cache, "train.ckpt_every=3", "data.total_batch_tokens=1024"),
        lambda c, i: R.LMTask(c, i),
        str(crashed),
        resume=True,
    )
    a = load_tensors(ref / "final" / "model.safetensors")
    b = load_tensors(crashed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    la = [r["loss"] for r in RunDir(ref).metrics() if "loss" in r]
    lb = [r["loss"] for r in RunDir(crashed).metrics() if "loss" in r]
    assert la == lb and len(la) == 8


def test_errors_before_training(cache, tmp_path):
    out = tmp_path / "run"
    build = lambda c, i: R.LMTask(c, i)  # noqa: E731
    with pytest.raises(ConfigError, match="laplacian_heads"):
        launch("lm", _cfg(cache, "model.laplacian_heads=5"), build, str(out))
    with pytest.raises(ConfigError, match="vocab"):
        launch("lm", _cfg(cache, "model.vocab_size=1000"), build, str(out))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        launch("lm", _cfg(cache, f"data.corpus={empty}"), build, str(out))
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": ""}\n\n{"text": ""}\n')
    with pytest.raises(DataError, match="empty"):
        launch("lm", _cfg(cache, f"data.corpus=[{blank}]"), build, str(out))
    with pytest.raises(ConfigError, match="tokenizer"):
        launch("lm", _cfg(cache, f"data.shards={tmp_path}"), build, str(out))
    with pytest.raises(DataError, match="seq_len"):
        launch("lm", _cfg(cache, "data.seq_len=100000"), build, str(out))
    assert not out.exists()  # nothing was written
    with pytest.raises(CheckpointError):
        R.load_model(tmp_path)


def test_train_lm_cli_with_prebuilt_shards(cache, tmp_path, capsys):
    from lapheads.cli import main as cli

    tok_dir, shard_dir = tmp_path / "tok", tmp_path / "shards"
    assert cli(["tokenizer", "train", "--embedded", "--vocab-size", "400", "--out", str(tok_dir)]) == 0
    assert (
        cli(["data", "tokenize", "--embedded", "--tokenizer", str(tok_dir), "--out", str(shard_dir), "--no-progress"])
        == 0
    )
    out = tmp_path / "run"
    rc = cli(
        [
            "train",
            "lm",
            "--config",
            str(CONFIG_DIR / "lm" / "tiny.yaml"),
            "--out",
            str(out),
            "--set",
            f"data.shards={shard_dir}",
            "--set",
            f"data.tokenizer={tok_dir}",
            "--set",
            "model.depth=2",
            "--set",
            "model.width=64",
            "--set",
            "data.seq_len=32",
            "--set",
            "data.batch_size=4",
            "--set",
            "data.total_batch_tokens=0",
            "--set",
            "train.max_steps=2",
            "--set",
            "train.progress=false",
            "--set",
            "samples.max_new_tokens=2",
            "--set",
            "data.eval_tokens=256",
        ]
    )
    assert rc == 0
    assert "val_bpb" in capsys.readouterr().out
    assert (out / "final" / "hf" / "tokenizer.json").is_file()
    # a vocabulary mismatch between tokenizer and model is one clear line, exit status 2
    rc = cli(
        [
            "train",
            "lm",
            "--config",
            str(CONFIG_DIR / "lm" / "tiny.yaml"),
            "--out",
            str(tmp_path / "bad"),
            "--set",
            f"data.shards={shard_dir}",
            "--set",
            f"data.tokenizer={tok_dir}",
            "--set",
            "model.vocab_size=2048",
        ]
    )
    assert rc == 2 and "vocab" in capsys.readouterr().err
