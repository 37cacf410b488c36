"""The attention variants of the recipes (model.attention: standard | laplacian | diff | xsa), each
against a formula written here in float64; refusals; the LM's variant survives save and load; the
report groups runs by variant."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from lapheads import ConfigError
from lapheads.variants import check_attention, variant_label, xsa


def _softmax_pv(q, k, v, causal=False):
    """softmax(q k^T / sqrt(d)) V by exp / sum (no SDPA); queries are the last Tq positions of the keys."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        tq, tk = s.shape[-2], s.shape[-1]
        row = torch.arange(tq)[:, None] + (tk - tq)
        s = s.masked_fill(torch.arange(tk)[None, :] > row, float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ v


def _xsa_by_token(y, v):
    """y - (y . v) v / (v . v), one head and token at a time (v = 0: y)."""
    out = torch.empty_like(y)
    g = y.shape[1] // v.shape[1]
    for b in range(y.shape[0]):
        for h in range(y.shape[1]):
            for t in range(y.shape[2]):
                yt, vt = y[b, h, t], v[b, h // g, t]
                vv = float((vt @ vt).detach())
                out[b, h, t] = yt - (yt @ vt) / vv * vt if vv > 0 else yt
    return out


@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_xsa_matches_the_formula(hkv):
    g = torch.Generator().manual_seed(0)
    y = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, hkv, 5, 8, generator=g, dtype=torch.float64)
    v[0, 0, 1] = 0.0  # a zero value: nothing removed
    got = xsa(y, v)
    torch.testing.assert_close(got, _xsa_by_token(y, v), atol=1e-12, rtol=0)
    # the output is orthogonal to the token's own value
    vrep = v.repeat_interleave(4 // hkv, dim=1)
    assert float((got * vrep).sum(-1).abs().max()) < 1e-12


def test_xsa_refuses_heads_that_do_not_group():
    with pytest.raises(ConfigError, match="not a multiple"):
        xsa(torch.zeros(1, 3, 2, 4), torch.zeros(1, 2, 2, 4))


def test_check_attention_refuses_heads_with_another_attention():
    check_attention("laplacian", "all")
    for name in ("standard", "diff", "xsa"):
        check_attention(name, 0)
        check_attention(name, "identity:0")
        with pytest.raises(ConfigError, match=rf"model.attention='{name}'.*laplacian_heads=0"):
            check_attention(name, 2)
    with pytest.raises(ConfigError, match="must be one of"):
        check_attention("neutreno", 0)
    assert [variant_label(a, "k=0") for a in ("laplacian", "standard", "diff", "xsa")] == ["k=0", "k=0", "diff", "xsa"]


# ------------------------------------------------------------------------------------ classify (timm)
def _classify_model(attention, heads=0):
    from lapheads.engine.config import from_dict
    from lapheads.recipes.classify import ModelConfig, build_model

    m = from_dict(
        ModelConfig,
        {
            "name": "vit_tiny_patch16_224",
            "img_size": 16,
            "patch_size": 4,
            "embed_dim": 32,
            "depth": 2,
            "num_heads": 4,
            "qk_norm": False,
            "laplacian_heads": heads,
            "attention": attention,
        },
    )
    torch.manual_seed(0)
    return build_model(m, 10).double().eval()


def _qkv(attn, x, heads, head_dim):
    b, n, _ = x.shape
    qkv = x @ attn.qkv.weight.T + (attn.qkv.bias if attn.qkv.bias is not None else 0)
    return qkv.reshape(b, n, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)


def test_classify_xsa_layer_matches_the_formula():
    from lapheads.vision.attention import XSAAttention

    model = _classify_model("xsa")
    attn = model.blocks[0].attn
    assert type(attn) is XSAAttention
    x = torch.randn(2, 17, 32, dtype=torch.float64)
    q, k, v = _qkv(attn, x, 4, 8)
    y = _xsa_by_token(_softmax_pv(q, k, v), v)
    want = y.transpose(1, 2).reshape(2, 17, 32) @ attn.proj.weight.T + attn.proj.bias
    torch.testing.assert_close(attn(x), want, atol=1e-12, rtol=0)


def test_classify_xsa_state_dict_never_loads_silently_into_stock_attention():
    """An XSA model's state dict has one marker per layer: a strict load into the stock timm model
    refuses it; stock weights (no marker) load into the XSA model, whose output then differs."""
    import timm

    model = _classify_model("xsa")
    sd = model.state_dict()
    assert [k for k in sd if k.endswith(".attn.xsa")] == ["blocks.0.attn.xsa", "blocks.1.attn.xsa"]
    from lapheads.recipes.classify import ModelConfig, timm_kwargs

    m = ModelConfig.model_validate(
        {"name": "vit_tiny_patch16_224", "img_size": 16, "patch_size": 4, "embed_dim": 32, "depth": 2}
        | {"num_heads": 4, "qk_norm": False}
    )
    torch.manual_seed(1)
    stock = timm.create_model(m.name, pretrained=False, **timm_kwargs(m, 10)).double().eval()  # plain timm
    assert type(stock.blocks[0].attn) is timm.layers.Attention
    with pytest.raises(RuntimeError, match="Unexpected key.*blocks.0.attn.xsa"):
        stock.load_state_dict(sd)
    fresh = _classify_model("xsa")
    fresh.load_state_dict(stock.state_dict())  # stock weights into XSA layers: strict, accepted
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    assert float((fresh(x) - stock(x)).abs().max()) > 1e-6
    again = _classify_model("xsa")
    again.load_state_dict(sd)
    torch.testing.assert_close(again(x), model(x), atol=0, rtol=0)


def test_classify_diff_is_timms_diffattention_and_matches_the_paper():
    from timm.layers.diff_attention import DiffAttention

    model = _classify_model("diff")
    assert all(type(b.attn) is DiffAttention for b in model.blocks)
    attn = model.blocks[1].attn
    x = torch.randn(2, 17, 32, dtype=torch.float64)
    b, n, heads, d = 2, 17, 4, 4  # diff attention: 2 * heads query/key heads of half width
    qkv = x @ attn.qkv.weight.T
    q, k, v = qkv.split(32, dim=-1)
    q = q.reshape(b, n, 2 * heads, d).transpose(1, 2)
    k = k.reshape(b, n, 2 * heads, d).transpose(1, 2)
    v = v.reshape(b, n, heads, 2 * d).transpose(1, 2)
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * 1)  # depth index 1
    lam = (
        math.exp(float((attn.lambda_q1 @ attn.lambda_k1).detach()))
        - math.exp(float((attn.lambda_q2 @ attn.lambda_k2).detach()))
        + lam_init
    )
    out = _softmax_pv(q[:, 0::2], k[:, 0::2], v) - lam * _softmax_pv(q[:, 1::2], k[:, 1::2], v)
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.sub_norm.weight * (1 - lam_init)
    want = out.transpose(1, 2).reshape(b, n, 32) @ attn.proj.weight.T + attn.proj.bias
    # timm computes lambda in float32 (`_compute_lambda`), so the float64 output agrees to float32's rounding
    torch.testing.assert_close(attn(x), want, atol=1e-6, rtol=0)


def test_classify_standard_is_plain_attention_and_refusals_are_one_line():
    from lapheads.engine.config import load_config
    from lapheads.recipes.classify import ClassifyConfig
    from lapheads.recipes.shipped import CONFIG_DIR

    std, lap0 = _classify_model("standard"), _classify_model("laplacian", 0)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    torch.testing.assert_close(std(x), lap0(x), atol=0, rtol=0)
    digits = CONFIG_DIR / "classify" / "digits.yaml"  # laplacian_heads: all
    with pytest.raises(ConfigError, match=r"model.attention='xsa'.*set model.laplacian_heads=0"):
        load_config(ClassifyConfig, digits, ["model.attention=xsa"])
    with pytest.raises(ConfigError, match="model.attention"):
        load_config(ClassifyConfig, digits, ["model.attention=sparse", "model.laplacian_heads=0"])


# ------------------------------------------------------------------------------------ lm (transformers)
def _lm(attention, heads=0, kv=None):
    from lapheads.lm.model import LMModelConfig, build_model

    torch.manual_seed(0)
    cfg = LMModelConfig(depth=2, width=32, n_heads=4, n_kv_heads=kv, laplacian_heads=heads, attention=attention)
    model = build_model(cfg, 50, 16)
    for layer in model.model.layers:  # nanochat starts o_proj at zero: give the attention a say
        torch.nn.init.normal_(layer.self_attn.o_proj.weight, std=0.2)
    torch.nn.init.normal_(model.lm_head.weight, std=0.2)
    return model.double().eval()


def _reference_attention(module, query, key, value, attention_mask, **kwargs):
    """Softmax by exp / sum with the causal rule written here, then the XSA formula by token."""
    g = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    y = _softmax_pv(query, k, v, causal=True)
    return _xsa_by_token(y, value[..., -query.shape[-2] :, :]).transpose(1, 2), None


@pytest.mark.parametrize("kv", [None, 2])
def test_lm_xsa_matches_the_formula(kv):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from lapheads.lm.attention import XSA_IMPLEMENTATION

    model = _lm("xsa", kv=kv)
    assert model.config._attn_implementation == XSA_IMPLEMENTATION
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    got = model(ids).logits
    AttentionInterface.register("test_xsa_reference", _reference_attention)
    AttentionMaskInterface.register("test_xsa_reference", sdpa_mask)
    model.set_attn_implementation("test_xsa_reference")
    torch.testing.assert_close(got, model(ids).logits, atol=1e-10, rtol=0)
    # and it is not standard attention
    model.set_attn_implementation("sdpa")
    assert float((got - model(ids).logits).abs().max()) > 1e-3


def test_lm_xsa_generates_with_a_cache_as_without():
    model = _lm("xsa")
    ids = torch.randint(0, 50, (1, 5), generator=torch.Generator().manual_seed(2))
    out = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True)
    x = ids
    for _ in range(4):  # greedy by recomputing the whole sequence
        x = torch.cat([x, model(x).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, x)


def test_lm_variant_survives_save_and_load(tmp_path):
    from lapheads import transformers as lap_tf
    from lapheads.lm.attention import XSA_IMPLEMENTATION, apply_variant

    model = _lm("xsa")
    ids = torch.randint(0, 50, (2, 7))
    want = model(ids).logits
    model.save_pretrained(str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["lapheads_attention"] == "xsa"
    back = lap_tf.from_pretrained(str(tmp_path / "hf")).double().eval()
    assert apply_variant(back) == "xsa" and back.config._attn_implementation == XSA_IMPLEMENTATION
    torch.testing.assert_close(back(ids).logits, want, atol=1e-12, rtol=0)
    # a plain load builds XSA too (the implementation name is in config.json) ...
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).double().eval()
    assert plain.config._attn_implementation == XSA_IMPLEMENTATION
    torch.testing.assert_close(plain(ids).logits, want, atol=1e-12, rtol=0)
    # ... and an interpreter without lapheads refuses it at load instead of building standard attention
    code = (
        "import sys; from transformers import AutoModelForCausalLM\n"
        "try:\n    AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "except ValueError as e:\n    print('refused:', e); sys.exit(0)\n"
        "sys.exit('loaded')"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "hf")], capture_output=True, text=True)
    assert r.returncode == 0 and "lapheads_xsa" in r.stdout, (r.stdout, r.stderr[-2000:])
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["lapheads_attention"] = "neutreno"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    from lapheads.errors import CheckpointError

    with pytest.raises(CheckpointError, match="lapheads_attention='neutreno'"):
        apply_variant(lap_tf.from_pretrained(str(tmp_path / "hf")), "hf")


def test_lm_refuses_diff_and_heads_with_xsa():
    from lapheads.lm.model import LMModelConfig, build_model

    with pytest.raises(ConfigError, match="classify recipe only"):
        build_model(LMModelConfig(depth=1, width=32, n_heads=4, laplacian_heads=0, attention="diff"), 50, 8)
    with pytest.raises(ConfigError, match="laplacian_heads=0"):
        build_model(LMModelConfig(depth=1, width=32, n_heads=4, laplacian_heads=2, attention="xsa"), 50, 8)


# ------------------------------------------------------------------------------------ report
def test_report_groups_runs_by_variant(tmp_path):
    from lapheads.cli import main as cli
    from lapheads.recipes.shipped import CONFIG_DIR

    tiny = ["model.embed_dim=32", "model.depth=1", "model.num_heads=2", "train.max_steps=2", "train.progress=false"]
    tiny += ["data.max_eval_items=32", "model.laplacian_heads=0"]
    runs = []
    for attention in ("standard", "xsa", "diff"):
        out = tmp_path / attention
        sets = [a for s in [*tiny, f"model.attention={attention}"] for a in ("--set", s)]
        assert (
            cli(
                [
                    "train",
                    "classify",
                    "--config",
                    str(CONFIG_DIR / "classify" / "digits.yaml"),
                    "--out",
                    str(out),
                    *sets,
                ]
            )
            == 0
        )
        runs.append(str(out))
    assert cli(["report", *runs, "--analyze", "--out", str(tmp_path / "report")]) == 0
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert set(summary["classify"]) >= {"k=0", "xsa", "diff"}
    for run in runs:  # the geometry of every variant was measured (the capture reads the blocks' outputs)
        geo = json.loads((tmp_path / run.rsplit("/", 1)[-1] / "geometry" / "geometry.json").read_text())
        last = [n for n in geo["layers"] if n != "pre_logits"][-1]
        assert geo["layers"][last]["spectra"]["k_mean"] > 0
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| xsa |" in md and "| diff |" in md


def test_class_geometry_of_identical_class_means_is_nan_not_an_error():
    """A ViT whose heads are all identity never lets CLS see the image: every class mean is the same."""
    from lapheads.geometry.classes import _pairwise

    out = _pairwise(torch.zeros(3, 4, dtype=torch.float64), torch.ones(3, dtype=torch.float64), tile=2)
    assert math.isnan(out["etf_distance"]) and math.isnan(out["cdnv"]) and out["n_pairs_coincident"] == 3
