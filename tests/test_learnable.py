"""Learnable head mixing ``a_h I + b_h P``: spec, operator, nn / timm / transformers,
optimizer groups, saving and loading, KV cache, logging and the suggested fixed selection."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _lm_helpers import greedy_by_recompute
from timm.models.vision_transformer import VisionTransformer
from transformers import LlamaConfig, LlamaForCausalLM, NanoChatConfig, NanoChatForCausalLM

import lapheads.timm as ltimm
import lapheads.transformers as ltr
from lapheads import (
    ConfigError,
    HeadMix,
    LaplacianHeads,
    laplacian_attention,
    laplacian_attention_reference,
    mixing_table,
    suggest_selection,
)
from lapheads.heads import laplacianness, nearer_laplacian, param_groups
from lapheads.nn import MultiheadAttention
from lapheads.recipes.shipped import CONFIG_DIR


def _qkv(h=4, hkv=None, tq=6, tk=6, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hkv = hkv or h
    return (
        torch.randn(2, h, tq, d, generator=g, dtype=dtype),
        torch.randn(2, hkv, tk, d, generator=g, dtype=dtype),
        torch.randn(2, hkv, tk, d, generator=g, dtype=dtype),
    )


def _mix(h=4, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return HeadMix(torch.randn(h, generator=g, dtype=dtype), torch.randn(h, generator=g, dtype=dtype))


# ----------------------------------------------------------------------------- the spec
@pytest.mark.parametrize(
    "spec, canonical, flags",
    [
        ("learn", "learn:standard", (False, False, False, False)),
        ("Learn:Laplacian", "learn:laplacian", (True, True, True, True)),
        ("learn:3", "learn:3", (False, True, True, True)),
        (LaplacianHeads.learn(2), "learn:2", (False, False, True, True)),
    ],
)
def test_learn_spec_parses_and_initialises(spec, canonical, flags):
    s = LaplacianHeads(spec)
    assert s.learnable and s.spec == canonical and s.to_config() == canonical and s.label() == canonical
    assert [sel.flags for sel in s.init_selection(2, 4)] == [flags, flags]
    assert LaplacianHeads(s.to_config()) == s
    with pytest.raises(ConfigError, match="learnable mixing"):
        s.resolve(2, 4)  # not a fixed set of heads: fixed code paths cannot take it by mistake


@pytest.mark.parametrize("bad", ["learn:maybe", "learn:-1", "learnt"])
def test_bad_learn_specs_are_refused(bad):
    with pytest.raises(ConfigError):
        LaplacianHeads(bad)
    with pytest.raises(ConfigError, match="only 4 heads"):
        LaplacianHeads("learn:5").init_selection(1, 4)


def test_operator_refuses_a_learn_string_and_bad_mix():
    q, k, v = _qkv()
    with pytest.raises(ConfigError, match="learnable mixing"):
        laplacian_attention(q, k, v, laplacian_heads="learn")
    with pytest.raises(ConfigError, match=r"shape \(4,\)"):
        laplacian_attention(q, k, v, laplacian_heads=HeadMix(torch.zeros(3), torch.ones(3)))
    q2, k2, v2 = _qkv(tq=7, tk=6)
    with pytest.raises(ConfigError, match="Tq=7 > Tk=6"):
        laplacian_attention(q2, k2, v2, laplacian_heads=_mix())


# ----------------------------------------------------------------------------- the operator
@pytest.mark.parametrize("case", ["self", "causal", "kv-cache", "gqa", "mask"])
def test_mixed_operator_equals_explicit_a_i_plus_b_p(case):
    kw: dict = {}
    if case == "gqa":
        q, k, v = _qkv(h=4, hkv=2)
        kw["enable_gqa"] = True
    elif case == "kv-cache":
        q, k, v = _qkv(tq=2, tk=7)
        kw["is_causal"] = True
    else:
        q, k, v = _qkv()
        kw["is_causal"] = case == "causal"
        if case == "mask":
            m = torch.ones(2, 1, 6, 6, dtype=torch.bool)
            m[0, :, 3] = False  # a query that sees nothing: P = 0, output a * v_self
            m[1, :, :, 0] = False
            kw["attn_mask"] = m
    mix = _mix()
    out = laplacian_attention(q, k, v, laplacian_heads=mix, **kw)
    ref, op = laplacian_attention_reference(q, k, v, laplacian_heads=mix, **kw)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    # the operator is a I + b P with P the standard attention matrix
    _, p = laplacian_attention_reference(q, k, v, laplacian_heads="none", **kw)
    tq, tk = q.shape[-2], k.shape[-2]
    eye = torch.zeros(tq, tk, dtype=q.dtype)
    eye[torch.arange(tq), torch.arange(tk - tq, tk)] = 1
    expect = mix.a.view(-1, 1, 1) * eye + mix.b.view(-1, 1, 1) * p
    torch.testing.assert_close(op, expect, atol=1e-12, rtol=0)


def test_fixed_points_of_the_mixing_equal_the_fixed_operator():
    q, k, v = _qkv()
    a = torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    out = laplacian_attention(q, k, v, laplacian_heads=HeadMix(a, 1 - 2 * a), is_causal=True)
    fixed = laplacian_attention(q, k, v, laplacian_heads=2, is_causal=True)
    torch.testing.assert_close(out, fixed, atol=1e-12, rtol=0)


def test_gradients_reach_a_and_b_and_match_the_reference():
    q, k, v = _qkv()
    mix = HeadMix(*(t.clone().requires_grad_() for t in _mix()))
    laplacian_attention(q, k, v, laplacian_heads=mix).square().sum().backward()
    ga, gb = mix.a.grad.clone(), mix.b.grad.clone()
    mix.a.grad = mix.b.grad = None
    laplacian_attention_reference(q, k, v, laplacian_heads=mix)[0].square().sum().backward()
    torch.testing.assert_close(ga, mix.a.grad, atol=1e-10, rtol=0)
    torch.testing.assert_close(gb, mix.b.grad, atol=1e-10, rtol=0)
    assert ga.abs().min() > 0 and gb.abs().min() > 0


def test_half_precision_output_keeps_its_dtype():
    q, k, v = _qkv(dtype=torch.bfloat16)
    mix = _mix(dtype=torch.float32)  # float32 parameters, bf16 activations (autocast)
    assert laplacian_attention(q, k, v, laplacian_heads=mix).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- lapheads.nn
def test_nn_learnable_parameters_state_dict_and_weights():
    torch.manual_seed(0)
    m = MultiheadAttention(16, 4, batch_first=True, laplacian_heads="learn:2").double()
    assert m.lap_mix_a.tolist() == [0, 0, 1, 1] and m.lap_mix_b.tolist() == [1, 1, -1, -1]
    fixed = MultiheadAttention(16, 4, batch_first=True, laplacian_heads=2).double()
    assert "lap_mix_a" not in fixed.state_dict()  # the fixed path stays parameter-free
    fixed.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("lap_mix")})
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    out, w = m(x, x, x, average_attn_weights=False)
    ref, wref = fixed(x, x, x, average_attn_weights=False)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(w, wref)
    with torch.no_grad():
        m.lap_mix_a.copy_(torch.tensor([0.2, -0.3, 0.5, 1.5]))
    fused, _ = m(x, x, x, need_weights=False)
    eager, _ = m(x, x, x, need_weights=True)
    torch.testing.assert_close(fused, eager)
    again = MultiheadAttention(16, 4, batch_first=True, laplacian_heads="learn").double()
    again.load_state_dict(m.state_dict())
    torch.testing.assert_close(again(x, x, x)[0], eager)
    from_t = MultiheadAttention.from_torch(torch.nn.MultiheadAttention(16, 4), laplacian_heads="learn")
    assert from_t.lap_mix_b.tolist() == [1, 1, 1, 1]


# ----------------------------------------------------------------------------- lapheads.timm
def _vit():
    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5).eval()


def test_timm_learnable_matches_fixed_at_init_and_fused_equals_eager():
    x = torch.randn(2, 3, 16, 16)
    fixed = ltimm.convert(_vit(), 2)
    model = ltimm.convert(_vit(), "learn:2")
    names = [n for n, _ in model.named_parameters() if "lap_mix" in n]
    assert names == [
        "blocks.0.attn.lap_mix_a",
        "blocks.0.attn.lap_mix_b",
        "blocks.1.attn.lap_mix_a",
        "blocks.1.attn.lap_mix_b",
    ]
    assert not any("lap_mix" in n for n, _ in fixed.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(x), fixed(x), atol=1e-6, rtol=0)
        for blk in model.blocks:
            blk.attn.lap_mix_a.copy_(torch.tensor([0.3, -0.2, 0.9, 0.1]))
        fused = model(x)
        for blk in model.blocks:
            blk.attn.fused_attn = False
        eager = model(x)
    torch.testing.assert_close(fused, eager, atol=1e-5, rtol=0)
    assert not torch.allclose(fused, fixed(x), atol=1e-3)
    restored = ltimm.convert(_vit(), "learn")
    restored.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(restored(x), fused, atol=1e-6, rtol=0)
    ltimm.convert(restored, 1)  # back to a fixed selection: the parameters go away
    assert not any("lap_mix" in n for n, _ in restored.named_parameters())


def test_timm_with_heads_and_create_model_accept_learn():
    cls = ltimm.LaplacianAttention.with_heads("learn:laplacian")
    model = VisionTransformer(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5, attn_layer=cls
    )
    assert model.blocks[1].attn.lap_mix_a.tolist() == [1, 1, 1, 1]
    m2 = ltimm.create_model(
        "vit_tiny_patch16_224",
        laplacian_heads="learn",
        img_size=16,
        patch_size=4,
        embed_dim=32,
        depth=2,
        num_heads=4,
        num_classes=3,
    )
    assert m2.laplacian_heads == LaplacianHeads("learn:standard")
    assert [r["layer"] for r in mixing_table(m2)] == ["blocks.0.attn", "blocks.1.attn"]


# ----------------------------------------------------------------------------- lapheads.transformers
def _nanochat(heads, seed=0):
    torch.manual_seed(seed)
    cfg = NanoChatConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    model = NanoChatForCausalLM(cfg).double().eval()
    ltr.enable(model, heads)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _perturb(model):
    with torch.no_grad():
        for i, m in enumerate(ltr.mixing_modules(model)):
            m.lap_mix_a.copy_(torch.tensor([0.4, -0.1, 0.8, 1.2]) + i)
            m.lap_mix_b.copy_(torch.tensor([0.7, 1.1, -0.5, -0.9]))


def test_transformers_learnable_equals_fixed_at_init_and_kv_cache_equals_full():
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    fixed = _nanochat(2)
    learn = _nanochat("learn:2")
    assert learn.config.laplacian_heads == "learn:2"
    assert [n for n, _ in learn.named_parameters() if "lap_mix" in n][:2] == [
        "model.layers.0.self_attn.lap_mix_a",
        "model.layers.0.self_attn.lap_mix_b",
    ]
    with torch.no_grad():
        torch.testing.assert_close(learn(ids).logits, fixed(ids).logits, atol=1e-12, rtol=0)
    _perturb(learn)
    gen = learn.generate(ids, max_new_tokens=6, do_sample=False)
    seq = greedy_by_recompute(learn, ids, 6)
    assert torch.equal(gen, seq)
    with torch.no_grad():
        out = learn(seq[:, :-1], use_cache=True)
        step = learn(seq[:, -1:], cache=out.past_key_values).logits[:, -1]
        torch.testing.assert_close(step, learn(seq).logits[:, -1], atol=1e-10, rtol=0)
        # eager twin: same output, the operator a I + b P as attentions (rows sum to a + b)
        eager = _nanochat("learn:2")
        eager.load_state_dict(learn.state_dict())
        ltr.enable(eager, "learn:2", eager=True)
        eager.load_state_dict(learn.state_dict())
        res = eager(seq, output_attentions=True)
        torch.testing.assert_close(res.logits, learn(seq).logits, atol=1e-10, rtol=0)
        m0 = ltr.mixing_modules(learn)[0]
        torch.testing.assert_close(res.attentions[0].sum(-1)[0, :, 0], m0.lap_mix_a + m0.lap_mix_b)


def test_transformers_gqa_learnable_runs():
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).eval()
    ltr.enable(model, "learn:laplacian")
    assert ltr.mixing_modules(model)[0].lap_mix_a.shape == (4,)
    fixed = LlamaForCausalLM(model.config.__class__(**{**model.config.to_dict(), "laplacian_heads": "all"})).eval()
    fixed.load_state_dict({k: v for k, v in model.state_dict().items() if "lap_mix" not in k})
    ltr.enable(fixed, "all")
    ids = torch.randint(3, 97, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, fixed(ids).logits, atol=1e-5, rtol=0)


def test_transformers_save_and_from_pretrained_restore_the_learned_values(tmp_path):
    model = _nanochat("learn")
    _perturb(model)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["laplacian_heads"] == "learn:standard"
    loaded = ltr.from_pretrained(str(tmp_path), dtype=torch.float64).eval()
    assert mixing_table(loaded) == mixing_table(model)
    ids = torch.randint(3, 97, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-12, rtol=0)
    # a plain load builds modules without the parameters: refused at the first forward, naming the fix
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match="lapheads.transformers.from_pretrained"):
        plain(ids)
    # a checkpoint without the parameters is refused by our loader
    fixed = _nanochat(0)
    fixed.config.laplacian_heads = "learn"
    fixed.save_pretrained(tmp_path / "bad")
    with pytest.raises(ConfigError, match="lacks"):
        ltr.from_pretrained(str(tmp_path / "bad"))


def test_from_pretrained_of_a_hub_id_restores_the_learned_values(tmp_path, monkeypatch):
    """A hub id resolves through the hub cache like transformers' own loader (no network: a cache
    laid out as huggingface_hub writes it, local_files_only), sharded checkpoints included."""
    model = _nanochat("learn")
    _perturb(model)
    snap = tmp_path / "hub" / "models--someone--tiny-learn" / "snapshots" / ("a" * 40)
    model.save_pretrained(snap, max_shard_size="20KB")
    assert (snap / "model.safetensors.index.json").is_file()  # sharded: the mixing sits in some shard
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("a" * 40)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 at start-up
    loaded = ltr.from_pretrained(
        "someone/tiny-learn", cache_dir=str(tmp_path / "hub"), local_files_only=True, dtype=torch.float64
    ).eval()
    assert mixing_table(loaded) == mixing_table(model)
    ids = torch.randint(3, 97, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-12, rtol=0)


def test_enable_with_a_fixed_spec_removes_the_parameters():
    model = _nanochat("learn")
    ltr.enable(model, 1)
    assert not any("lap_mix" in n for n, _ in model.named_parameters())


# ----------------------------------------------------------------------------- optimizers
def test_lm_optimizers_put_the_mixing_in_adamw_without_weight_decay():
    from lapheads.lm.model import LMModelConfig, LMOptimConfig, build_model, build_optimizers, param_groups

    model = build_model(LMModelConfig(depth=2, width=32, n_heads=4, laplacian_heads="learn:1"), 64, 16)
    groups = param_groups(model)
    assert [n for n, _ in groups["mix"]] == [f"model.layers.{i}.self_attn.lap_mix_{c}" for i in (0, 1) for c in "ab"]
    adamw, muon = build_optimizers(model, LMOptimConfig(weight_decay=0.1))
    mix = [g for g in adamw.param_groups if g["name"] == "mix"]
    assert len(mix) == 1 and mix[0]["weight_decay"] == 0.0 and len(mix[0]["params"]) == 4
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    assert not muon_ids & {id(p) for _, p in groups["mix"]}
    assert model.model.layers[0].self_attn.lap_mix_a.tolist() == [0, 0, 0, 1]


def test_classify_optimizer_excludes_the_mixing_from_weight_decay():
    from lapheads.engine.dist import DistInfo
    from lapheads.recipes.classify import ClassifyConfig, ClassifyTask

    cfg = ClassifyConfig()
    cfg.model.name, cfg.model.img_size, cfg.model.patch_size = "vit_tiny_patch16_224", 8, 4
    cfg.model.embed_dim, cfg.model.depth, cfg.model.num_heads, cfg.model.laplacian_heads = 16, 1, 2, "learn"
    cfg.data.train, cfg.data.three_augment = "digits", False
    task = ClassifyTask(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    (opt,) = task.optimizers()
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    mix = [p for n, p in task.model.named_parameters() if "lap_mix" in n]
    assert len(mix) == 2 and not decayed & {id(p) for p in mix}


@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_classify_mix_lr_scale_sets_the_mixing_learning_rate(scale):
    from lapheads.engine.config import from_dict
    from lapheads.engine.dist import DistInfo
    from lapheads.recipes.classify import ClassifyConfig, ClassifyTask

    cfg = ClassifyConfig()
    cfg.model.name, cfg.model.img_size, cfg.model.patch_size = "vit_tiny_patch16_224", 8, 4
    cfg.model.embed_dim, cfg.model.depth, cfg.model.num_heads, cfg.model.laplacian_heads = 16, 2, 2, "learn"
    cfg.data.train, cfg.data.three_augment = "digits", False
    cfg.optim.lr, cfg.optim.lr_batch, cfg.optim.mix_lr_scale = 2e-3, 0, scale
    task = ClassifyTask(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    (opt,) = task.optimizers()
    mix = {id(p) for n, p in task.model.named_parameters() if "lap_mix" in n}
    lr_of = {id(p): (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
    assert len(mix) == 4
    assert all(lr_of[i][0] == pytest.approx(2e-3 * scale) and lr_of[i][1] == 0.0 for i in mix)
    assert all(lr == pytest.approx(2e-3) for i, (lr, _) in lr_of.items() if i not in mix)
    # the default keeps today's two groups (mixing inside the no-decay group): old checkpoints resume
    assert len(opt.param_groups) == (2 if scale == 1.0 else 3)
    with pytest.raises(ConfigError, match="mix_lr_scale"):
        from_dict(ClassifyConfig, {"optim": {"mix_lr_scale": -1.0}})


# ----------------------------------------------------------------------------- logging and suggestion
def test_mixing_table_and_suggested_selection():
    assert laplacianness(0, 1) == 0 and laplacianness(1, -1) == 1
    # scale-free: the output projection absorbs a common factor of (a, b), sign included
    assert laplacianness(2, -2) == pytest.approx(1) and laplacianness(-1, 1) == pytest.approx(1)
    assert laplacianness(0.5, -1.4) == pytest.approx(0.4369, abs=1e-3)  # a sign-flipped P - 0.36 I: nearer P
    assert abs(laplacianness(1, 0)) == pytest.approx(2) and math.isnan(laplacianness(0, 0))
    assert [nearer_laplacian(x) for x in (0.4, 0.6, -1.4, -1.6, -2.0, math.nan)] == [
        False,
        True,
        False,
        True,
        True,
        False,
    ]
    model = ltimm.convert(_vit(), "learn")
    with torch.no_grad():
        model.blocks[0].attn.lap_mix_a.copy_(torch.tensor([0.0, 1.0, 0.9, 0.2]))
        model.blocks[0].attn.lap_mix_b.copy_(torch.tensor([1.0, -1.0, 0.1, 0.9]))
    table = mixing_table(model)
    json.dumps(table)  # plain JSON for metrics.jsonl
    assert table[0]["a"] == pytest.approx([0.0, 1.0, 0.9, 0.2]) and len(table) == 2
    assert suggest_selection([table]) == [[1, 2], []]
    assert LaplacianHeads(suggest_selection([table])).resolve(2, 4)[0].flags == (False, True, True, False)
    with pytest.raises(ConfigError, match="no learned mixing"):
        suggest_selection([[]])
    assert mixing_table(_vit()) == []


# ----------------------------------------------------------------------------- a training run
def test_classify_run_logs_the_mixing_and_restores_it(tmp_path):

    from lapheads.cli import main as cli
    from lapheads.recipes.classify import load_model

    digits = str(CONFIG_DIR / "classify" / "digits.yaml")
    out = tmp_path / "run"
    assert (
        cli(
            [
                "train",
                "classify",
                "--config",
                digits,
                "--out",
                str(out),
                "--set",
                "model.laplacian_heads=learn:1",
                "--set",
                "model.embed_dim=32",
                "--set",
                "model.depth=2",
                "--set",
                "model.num_heads=2",
                "--set",
                "train.max_steps=4",
                "--set",
                "train.progress=false",
                "--set",
                "data.batch_size=16",
                "--set",
                "data.max_eval_items=32",
                "--set",
                "optim.lr=0.05",
            ]
        )
        == 0
    )
    val = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in val if r.get("split") == "val"]
    logged = val[-1]["lap_mix"]
    assert [r["layer"] for r in logged] == ["blocks.0.attn", "blocks.1.attn"]
    assert logged[0]["a"] != [0.0, 1.0]  # trained away from the initialisation (head 1 started Laplacian)
    final = json.loads((out / "final" / "metrics.json").read_text())
    assert final["lap_mix"] == logged
    model = load_model(out)
    assert mixing_table(model) == logged
    from lapheads.report import build_report

    paths = build_report([out], tmp_path / "report")
    md = paths["md"].read_text()
    assert "classify_mixing.png" in md and (tmp_path / "report" / "figures" / "classify_mixing.png").is_file()
    assert f"learn:1: suggested fixed selection from 1 run(s): laplacian_heads={suggest_selection([logged])}" in md


def test_report_suggestion_averages_seeds(tmp_path):
    from lapheads.report import learned_mixing

    def run(seed, a):  # the stored "laplacianness" is stale on purpose: the report recomputes it from a, b
        return {
            "seed": seed,
            "final": {
                "lap_mix": [{"layer": "blocks.0.attn", "a": a, "b": [1.0, 1.0], "laplacianness": [9.0 for _ in a]}]
            },
        }

    # head 1: Laplacian-ness -atan(-0.5)/45 = 0.590 and -atan(-0.3)/45 = 0.371 -> mean 0.480, not above 0.5
    groups = {
        "learn:standard": {"runs": [run(0, [0.0, -0.5]), run(1, [0.0, -0.3])]},
        "k=0": {"runs": [{"seed": 0, "final": {"top1": 0.9}}]},
    }
    path, lines = learned_mixing(groups, tmp_path / "mix.png")
    assert path.is_file()
    assert lines == [
        "learn:standard: suggested fixed selection from 2 run(s): laplacian_heads=[[]] (Laplacian heads "
        "per layer [0]; a head is Laplacian when its mean Laplacian-ness -atan(a/b)/45deg puts it "
        "nearer I - P than P)"
    ]
    groups["learn:standard"]["runs"][1] = run(1, [0.0, -0.45])  # 0.534 -> mean 0.562
    assert "laplacian_heads=[[1]]" in learned_mixing(groups, tmp_path / "mix.png")[1][0]
    assert learned_mixing({"k=0": groups["k=0"]}, tmp_path / "none.png") is None


def test_param_groups_keep_the_mixing_out_of_weight_decay():
    """A user's AdamW(model.parameters(), weight_decay=wd) shrinks (a, b) towards (0, 0); the groups of
    param_groups leave them undecayed at lr * mix_lr_scale, and every other parameter as before."""

    def model():
        torch.manual_seed(0)
        return ltimm.create_model(
            "vit_tiny_patch16_224", laplacian_heads="learn:laplacian", img_size=32, patch_size=8, depth=2
        )

    names = {id(p): n for n, p in model().named_parameters()}
    m = model()
    groups = param_groups(m, lr=0.1, weight_decay=0.5, mix_lr_scale=10)
    mix = [n for n, p in m.named_parameters() if any(p is q for q in groups[1]["params"])]
    assert sorted(mix) == sorted(n for n in names.values() if n.endswith(("lap_mix_a", "lap_mix_b")))
    assert (groups[1]["lr"], groups[1]["weight_decay"], groups[0]["lr"], groups[0]["weight_decay"]) == (
        1.0,
        0.0,
        0.1,
        0.5,
    )
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(m.parameters()))
    # one step with a zero gradient: plain AdamW decays (a, b); the groups do not
    plain = (lambda m: torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5), True)
    grouped = (lambda m: torch.optim.AdamW(param_groups(m, lr=0.1, weight_decay=0.5)), False)
    for make, decays in (plain, grouped):
        m = model()
        opt = make(m)
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        before = m.blocks[0].attn.lap_mix_b.detach().clone()
        opt.step()
        torch.testing.assert_close(m.blocks[0].attn.lap_mix_b.detach(), before * (1 - 0.1 * 0.5) if decays else before)
    with pytest.raises(ConfigError, match="mix_lr_scale=0"):
        param_groups(m, lr=0.1, weight_decay=0.0, mix_lr_scale=0)
