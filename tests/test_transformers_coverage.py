"""lapheads.transformers beyond decoders: vision towers, encoders, encoder-decoders, soft-capping,
sinks and position bias, and the generated coverage table.

Every model is tiny (hidden 32, 2 layers of 4 heads) and float64. The reference attention is
written here, from the formula, not from lapheads: explicit scores ``q k^T * scale`` with the
model's own soft-cap / position bias / mask / sinks, ``P`` by a softmax, ``P V`` for a standard head
and ``V_own - P V`` for a Laplacian one, with the Laplacian heads of each module chosen by THIS
file from the module's name (the layer number in ``layer.3`` / ``layers.3`` / ``block.3``), so an
indexing bug in lapheads cannot be repeated by the reference.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers as tf
from _lm_helpers import greedy_by_recompute
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import lapheads.transformers as lt
from lapheads import ConfigError, laplacian_attention_reference

V = 99
SPEC = [1, 3]  # per layer: trailing 1 head in layer 0, trailing 3 in layer 1 (a wrong index is visible)
REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- tiny models
def _vision(**kw):
    return dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
        **kw,
    )


def _text(**kw):
    return dict(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
        **kw,
    )


def _make(cls, config):
    """Built in float64 from the start, as ``from_pretrained(..., dtype=float64)`` rebuilds it (buffers too)."""
    return cls._from_config(config, dtype=torch.float64)


def _build(arch: str):
    """``(model, stock implementation, attention class name)`` of a tiny float64 model."""
    torch.manual_seed(0)
    if arch == "vit":
        m = _make(tf.ViTModel, tf.ViTConfig(**_vision()))
        cls = "ViTAttention"
    elif arch == "deit":
        m = _make(tf.DeiTModel, tf.DeiTConfig(**_vision()))
        cls = "DeiTAttention"
    elif arch == "dinov2_registers":
        cfg = _vision(num_register_tokens=2, mlp_ratio=2)
        cfg.pop("intermediate_size")
        m = _make(tf.Dinov2WithRegistersModel, tf.Dinov2WithRegistersConfig(**cfg))
        cls = "Dinov2WithRegistersAttention"
    elif arch == "beit":  # relative position bias, handed to attention as an additive float mask
        m = _make(tf.BeitModel, tf.BeitConfig(**_vision(use_relative_position_bias=True)))
        cls = "BeitAttention"
    elif arch == "clip":
        m = _make(tf.CLIPModel, tf.CLIPConfig(text_config=_text(), vision_config=_vision(), projection_dim=16))
        cls = "CLIPAttention"
    elif arch == "siglip":
        m = _make(tf.SiglipModel, tf.SiglipConfig(text_config=_text(), vision_config=_vision()))
        cls = "SiglipAttention"
    elif arch == "bart":
        m = _make(
            tf.BartModel,
            tf.BartConfig(
                vocab_size=V,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=64,
            ),
        )
        cls = "BartAttention"
    elif arch == "t5":
        m = _make(
            tf.T5ForConditionalGeneration,
            tf.T5Config(
                vocab_size=V,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=4,
                decoder_start_token_id=0,
                relative_attention_num_buckets=8,
                pad_token_id=0,
            ),
        )
        cls = "T5Attention"
    elif arch == "gemma2":  # soft-cap 2.0: far from tanh's linear range, so dropping it would be visible
        m = _make(
            tf.Gemma2ForCausalLM,
            tf.Gemma2Config(
                vocab_size=V,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                attn_logit_softcapping=2.0,
                query_pre_attn_scalar=8,
                sliding_window=4,
                pad_token_id=0,
            ),
        )
        cls = "Gemma2Attention"
    elif arch == "gpt_oss":
        m = _make(
            tf.GptOssForCausalLM,
            tf.GptOssConfig(
                vocab_size=V,
                hidden_size=32,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=4,
                layer_types=["sliding_attention", "full_attention"],
                pad_token_id=0,
                experts_implementation="eager",
            ),
        )
        cls = "GptOssAttention"
        with torch.no_grad():  # sinks that take visible mass (the init is ~0.02)
            for layer in m.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
    else:
        raise AssertionError(arch)
    m = m.eval()
    stock = m.config._attn_implementation
    assert stock == ("eager" if arch in ("gemma2", "gpt_oss") else "sdpa")
    return m, stock, cls


ARCHS = ["vit", "deit", "dinov2_registers", "beit", "clip", "siglip", "bart", "t5", "gemma2", "gpt_oss"]


def _inputs(arch: str) -> dict:
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64)
    ids = torch.randint(3, V, (2, 8), generator=g)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, -2:] = 0  # right padding: no query row is ever fully masked
    if arch in ("vit", "deit", "dinov2_registers", "beit"):
        return {"pixel_values": pixels}
    if arch == "clip":
        return {"pixel_values": pixels, "input_ids": ids, "attention_mask": mask}
    if arch == "siglip":  # SigLIP's text tower takes no padding mask (it pools the last token)
        return {"pixel_values": pixels, "input_ids": ids}
    if arch in ("bart", "t5"):
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": torch.randint(3, V, (2, 5), generator=g)}
    return {"input_ids": ids, "attention_mask": mask}


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _flat(v)]
    return []


def _run(model, inputs) -> list[torch.Tensor]:
    import inspect

    extra = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    with torch.no_grad():
        return _flat(model(**inputs, **extra))


def _max_diff(a, b) -> float:
    assert len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b))
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- the reference, written here
_REF_K: dict[int, int] = {}  # id(attention module) -> trailing Laplacian heads (0: standard)


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    h, hkv = query.shape[1], key.shape[1]
    key = key.repeat_interleave(h // hkv, dim=1)
    value = value.repeat_interleave(h // hkv, dim=1)
    tq, tk = query.shape[2], key.shape[2]
    scale = scaling if scaling is not None else 1 / math.sqrt(query.shape[-1])
    scores = query @ key.transpose(-1, -2) * scale
    if kwargs.get("softcap") is not None:  # Gemma 2
        scores = torch.tanh(scores / kwargs["softcap"]) * kwargs["softcap"]
    if kwargs.get("position_bias") is not None:  # T5
        scores = scores + kwargs["position_bias"]
    if attention_mask is not None:
        scores = scores + attention_mask
    elif getattr(module, "is_causal", False) or kwargs.get("is_causal"):
        scores = scores.masked_fill(torch.ones(tq, tk, dtype=torch.bool).triu(tk - tq + 1), float("-inf"))
    sinks = kwargs.get("s_aux")
    if sinks is not None:  # GPT-OSS: one more logit per head in every row, its probability dropped
        col = sinks.reshape(1, h, 1, 1).expand(scores.shape[0], h, tq, 1)
        p = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(scores, dim=-1)
    out = p @ value
    k = _REF_K.get(id(module), 0)
    if k:
        own = value[:, :, tk - tq :, :]
        out = torch.cat([out[:, : h - k], own[:, h - k :] - out[:, h - k :]], dim=1)
    return out.transpose(1, 2).contiguous(), p


AttentionInterface.register("test_coverage_reference", _reference_attention)
AttentionMaskInterface.register("test_coverage_reference", eager_mask)
_CROSS = re.compile(r"EncDecAttention|encoder_attn|crossattention")
_LAYER = re.compile(r"\.(?:layer|layers|block)\.(\d+)\.")


def _reference(model, attention_class: str, spec=SPEC):
    """A copy of ``model`` on the reference attention, its Laplacian heads chosen from module names."""
    ref = copy.deepcopy(model)
    _REF_K.clear()
    for name, m in ref.named_modules():
        if type(m).__name__ == attention_class and not _CROSS.search(name):
            _REF_K[id(m)] = spec[int(_LAYER.search(f".{name}.").group(1))]
    assert len(_REF_K) >= 2
    ref.set_attn_implementation("test_coverage_reference")
    return ref


# --------------------------------------------------------------------------- per architecture
@pytest.mark.parametrize("arch", ARCHS)
def test_laplacian_output_equals_the_reference(arch):
    model, stock_impl, cls = _build(arch)
    inputs = _inputs(arch)
    stock = _run(model, inputs)
    lt.enable(model, SPEC)
    want = _run(_reference(model, cls), inputs)
    got = _run(model, inputs)
    assert _max_diff(got, want) < 1e-10
    assert _max_diff(got, stock) > 1e-4  # the Laplacian heads changed the model (the check above can fail)
    lt.enable(model, SPEC, eager=True)
    assert _max_diff(_run(model, inputs), want) < 1e-10
    # k = 0 is the stock model bit for bit (its own SDPA or eager attention in every layer)
    lt.enable(model, 0)
    assert _equal(_run(model, inputs), stock)


@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_reload_stays_laplacian(arch, tmp_path):
    model, stock_impl, _ = _build(arch)
    inputs = _inputs(arch)
    stock = _run(model, inputs)
    lt.enable(model, SPEC)
    want = _run(model, inputs)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    back = lt.from_pretrained(
        str(tmp_path), model_class=type(model), dtype=torch.float64, experts_implementation="eager"
    ).eval()
    got = _run(back, inputs)
    # 1e-12, not bit-identity: several stock models (CLIP, SigLIP, BART, T5, DINOv2) reload 1e-16 apart
    # without lapheads too, with an identical state_dict
    assert _max_diff(got, want) < 1e-12
    assert _max_diff(got, stock) > 1e-4
    # the concrete class reads config.json itself and refuses the checkpoint at load, lapheads imported or not
    with pytest.raises(ValueError, match="this checkpoint has Laplacian heads"):
        type(model).from_pretrained(tmp_path, dtype=torch.float64, experts_implementation="eager")
    if arch in ("gemma2", "gpt_oss"):  # decoders: a plain auto load reproduces them, under the no-"sdpa" name
        assert saved["attn_implementation"] == lt.SAVED_FUSED_ATTN_IMPLEMENTATION
        assert back.config._attn_implementation == lt.FUSED_ATTN_IMPLEMENTATION
        plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, experts_implementation="eager")
        assert _max_diff(_run(plain.eval(), inputs), want) < 1e-12
    else:  # encoders, towers, encoder-decoders: a plain auto load refuses its first forward in one line naming the fix
        assert saved["attn_implementation"] == lt.ATTN_IMPLEMENTATION + lt.INDEXED_ATTN_IMPLEMENTATION_SUFFIX
        plain = tf.AutoModel.from_pretrained(tmp_path, dtype=torch.float64).eval()
        with pytest.raises(ConfigError, match="lapheads.transformers.from_pretrained") as refused:
            _run(plain, inputs)
        assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="standard attention"):
        lt.from_pretrained(str(tmp_path), model_class=type(model), attn_implementation=stock_impl)


# --------------------------------------------------------------------------- what the index holds
def test_vision_tower_gets_its_index_in_encoder_order():
    model, _, _ = _build("vit")
    lt.enable(model, SPEC)
    mods = [layer.attention for layer in model.layers]
    assert [m.laplacian_layer for m in mods] == [0, 1] and all(m.laplacian_n_layers == 2 for m in mods)
    assert [m.laplacian_selection.count for m in mods] == SPEC
    assert all(m.laplacian_config is model.config for m in mods)
    assert not hasattr(mods[0], "layer_idx")  # per-module attributes only: the class is transformers'
    assert type(mods[0]) is tf.models.vit.modeling_vit.ViTAttention


def test_composite_config_holds_the_spec_per_tower(tmp_path):
    """CLIP: each tower's modules see their own sub-config, so the spec lives there (not on CLIPConfig)."""
    model, _, cls = _build("clip")
    inputs = _inputs("clip")
    lt.enable(model, {"vision_config": SPEC, "text_config": 0})
    assert model.config.vision_config.laplacian_heads == SPEC and model.config.text_config.laplacian_heads == 0
    assert getattr(model.config, "laplacian_heads", None) is None
    text = model.text_model.encoder.layers[0].self_attn
    vision = model.vision_model.encoder.layers[1].self_attn
    assert text.laplacian_config is model.config.text_config and not text.laplacian_selection.any
    assert vision.laplacian_config is model.config.vision_config and vision.laplacian_selection.count == 3
    ref = _reference(model, cls)
    for name, m in ref.named_modules():  # the text tower of the reference: standard
        if name.startswith("text_model"):
            _REF_K.pop(id(m), None)
    assert _max_diff(_run(model, inputs), _run(ref, inputs)) < 1e-10
    # the vision tower alone, loaded from the CLIP checkpoint, keeps its Laplacian heads
    model.save_pretrained(tmp_path)
    tower = lt.from_pretrained(str(tmp_path), model_class=tf.CLIPVisionModel, dtype=torch.float64).eval()
    assert tower.config.laplacian_heads == SPEC
    with torch.no_grad():
        a = tower(pixel_values=inputs["pixel_values"]).last_hidden_state
        b = model.vision_model(pixel_values=inputs["pixel_values"]).last_hidden_state
    assert (a - b).abs().max() < 1e-12
    with pytest.raises(ConfigError, match="no attention layers see"):
        lt.enable(model, {"audio_config": 1})


def test_encoder_decoder_index_and_cross_attention():
    """T5: encoder and decoder are separate stacks, numbered from 0 each; cross-attention stays standard."""
    model, _, _ = _build("t5")
    lt.enable(model, SPEC)
    enc = [b.layer[0].SelfAttention for b in model.encoder.block]
    dec = [b.layer[0].SelfAttention for b in model.decoder.block]
    cross = [b.layer[1].EncDecAttention for b in model.decoder.block]
    assert [m.laplacian_layer for m in enc] == [0, 1] == [m.laplacian_layer for m in dec]
    assert all(m.laplacian_cross for m in cross) and not any(m.laplacian_cross for m in enc + dec)
    assert all(m.laplacian_config is model.config for m in enc + dec)  # the stacks' configs are copies
    # a per-layer spec must fit every stack it applies to
    with pytest.raises(ConfigError, match="3 per-layer entries but the model has 2 layers"):
        lt.enable(model, [1, 2, 3])
    assert model.config.laplacian_heads == SPEC  # a refused spec leaves the old one in place


def test_t5_generate_with_cache_equals_full_recompute():
    model, _, _ = _build("t5")
    lt.enable(model, 2)
    ids = torch.randint(3, V, (1, 6), generator=torch.Generator().manual_seed(2))
    gen = model.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    dec = gen[:, :-1]
    with torch.no_grad():
        full = model(input_ids=ids, decoder_input_ids=dec, use_cache=False).logits[:, -1]
        enc = model.get_encoder()(input_ids=ids)
        out = model(encoder_outputs=enc, decoder_input_ids=dec[:, :-1], use_cache=True)
        step = model(encoder_outputs=enc, decoder_input_ids=dec[:, -1:], cache=out.past_key_values).logits[:, -1]
    assert torch.allclose(step, full, atol=1e-10, rtol=0)
    assert torch.equal(gen[:, -1], full.argmax(-1))


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_decoders_load_with_the_fused_name_and_generate_with_a_cache(arch, tmp_path):
    model, _, _ = _build(arch)
    lt.enable(model, 2)
    assert model.config._attn_implementation == lt.FUSED_ATTN_IMPLEMENTATION
    model.save_pretrained(tmp_path)
    # the name "laplacian_sdpa" is translated for a class without SDPA support (transformers would refuse it)
    back = lt.from_pretrained(
        str(tmp_path), attn_implementation=lt.ATTN_IMPLEMENTATION, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    assert back.config._attn_implementation == lt.FUSED_ATTN_IMPLEMENTATION
    with pytest.raises(ValueError, match="does not support an attention implementation through"):
        tf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=lt.ATTN_IMPLEMENTATION)
    back.generation_config.eos_token_id = None
    prompt = torch.randint(3, V, (1, 6), generator=torch.Generator().manual_seed(3))
    gen = back.generate(prompt, max_new_tokens=6, do_sample=False)  # past the sliding window of 4
    assert torch.equal(gen, greedy_by_recompute(back, prompt, 6))


def test_eager_twin_returns_the_operator_with_sinks():
    """GPT-OSS: with sinks the rows of P sum to less than 1, so a Laplacian row of I - P sums to more than 0."""
    model, _, _ = _build("gpt_oss")
    lt.enable(model, 2, eager=True)
    ids = torch.randint(3, V, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        op = model(ids, output_attentions=True).attentions[1][0]  # the full-attention layer
    sums = op.sum(-1)
    assert (sums[:2] < 1 - 1e-3).all() and (sums[:2] > 0).all()  # P with sinks
    assert (sums[2:] > 1e-3).all() and (sums[2:] < 1).all()  # I - P


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_soft_capping_through_flex_attention_score_mod():
    """The score_mod path (used inside torch.compile) equals the operator layer's explicit soft-capped attention."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[1, ..., :2] = False  # left padding of the second row: its first two queries see nothing
    pv = lt._flex_softcap_pv(q, k, v, mask, False, 0.3, 2.0)
    want, _ = laplacian_attention_reference(
        q, k, v, laplacian_heads="none", attn_mask=mask, scale=0.3, enable_gqa=True, softcap=2.0
    )
    assert (pv - want).abs().max() < 1e-10


def test_sparse_attention_indices_are_refused():
    model, _, _ = _build("gemma2")
    lt.enable(model, 1)
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 8, dtype=torch.float64)
    kv = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    idx = torch.zeros(1, 3, 2, dtype=torch.long)
    with pytest.raises(ConfigError, match="Gemma2Attention: sparse attention"):
        lt.laplacian_sdpa_attention_forward(attn, q, kv, kv, None, indices=idx)
    lt.enable(model, 0)  # the stock fallback would drop the selection too (transformers folds it only for its own)
    with pytest.raises(ConfigError, match="attn_implementation='sdpa' or 'eager'"):
        lt.laplacian_sdpa_attention_forward(attn, q, kv, kv, None, block_indices=idx)


def test_plain_model_without_index_is_refused_at_the_first_forward():
    """A ViT given the Laplacian implementation by hand, never indexed: refused, never silently standard."""
    model, _, _ = _build("vit")
    model.config.laplacian_heads = 1
    model.set_attn_implementation(lt.ATTN_IMPLEMENTATION)
    with pytest.raises(ConfigError, match="ViTAttention has no `config` or `layer_idx`.*enable"):
        _run(model, _inputs("vit"))


# --------------------------------------------------------------------------- the coverage table
@pytest.mark.slow  # scheduled first: the table builds one model per family
def test_coverage_table_is_current():
    """Regenerate docs/coverage-transformers.md; fail (with the diff) when the committed file differs."""
    doc = REPO / "docs" / "coverage-transformers.md"
    t0 = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "tools.coverage", "transformers", "--check", str(doc)],  # tools/: from the root
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        env=env,
    )
    took = time.perf_counter() - t0
    assert r.returncode == 0, (
        f"docs/coverage-transformers.md is stale (regenerate it with `python -m "
        f"tools.coverage transformers --write docs/coverage-transformers.md`):\n{r.stdout[-6000:]}{r.stderr[-2000:]}"
    )
    text = doc.read_text()
    assert "failed 0." in text.split("| # |")[0], "a family crashed or is silently standard"
    statuses = [line.split(" | ")[5] for line in text.splitlines() if re.match(r"\| \d+ \| ", line)]
    assert statuses and "failed" not in statuses, "a family crashed or is silently standard"
    print(f"coverage table regenerated in {took:.1f} s")
