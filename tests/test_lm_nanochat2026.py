"""nanochat's 2026 architecture options of the LM (value embeddings, sliding-window layers), against references
written here: an explicit forward pass (softmax with the banded causal mask, then V - P V for the flagged heads),
the KV-cache path against the full pass, and the defaults against the stock transformers model."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import NanoChatConfig, NanoChatForCausalLM
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer
from transformers.models.nanochat.modeling_nanochat import apply_rotary_pos_emb

from lapheads import transformers as lap_tf
from lapheads.engine.config import load_config
from lapheads.errors import ConfigError
from lapheads.lm.model import (
    LMModelConfig,
    LMOptimConfig,
    budget_params,
    build_model,
    build_optimizers,
    count_params,
    flops_per_token,
    param_groups,
)
from lapheads.lm.nanochat import LapNanoChatForCausalLM, default_short_window, window_layer_types
from lapheads.recipes import lm as R

V = 97  # vocabulary of the tiny models


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    base = dict(depth=4, width=32, n_heads=4, laplacian_heads=2, value_embeddings=True, window_pattern="SSSL")
    base.update(short_window=4)
    base.update(kw)
    m = build_model(LMModelConfig(**base), V, 64)
    with torch.no_grad():  # zero-initialised outputs would hide the attention from the logits
        for p in m.parameters():
            if not p.any():
                p.normal_(std=0.2)
    return m.double().eval()


def _rms(x):
    """NanoChat's RMSNorm, which computes in float32 whatever the dtype (the rest of the pass is float64)."""
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _reference_logits(m, ids, windows, lap_heads, ve_layers):
    """The forward pass of ``m`` written out: explicit scores, the banded causal mask, softmax, P V, and
    V - P V on the trailing ``lap_heads`` heads; value embeddings mixed in through 3 sigmoid(W x[:12])."""
    c = m.config
    B, T = ids.shape
    H, D = c.num_attention_heads, c.head_dim
    x = _rms(m.model.embed_tokens(ids))
    pos = torch.arange(T)[None]
    cos, sin = m.model.rotary_emb(x, pos)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    for layer, (blk, window) in enumerate(zip(m.model.layers, windows)):
        a = blk.self_attn
        h = _rms(x)
        q = a.q_proj(h).view(B, T, H, D).transpose(1, 2)
        k = a.k_proj(h).view(B, T, H, D).transpose(1, 2)
        v = a.v_proj(h).view(B, T, H, D).transpose(1, 2)
        if layer in ve_layers:
            gate = 3 * torch.sigmoid(h[..., :12] @ a.ve_gate.weight.T)  # (B, T, H)
            ve = m.model.value_embeds[str(layer)](ids).view(B, T, H, D).transpose(1, 2)
            v = v + gate.transpose(1, 2)[..., None] * ve
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        q, k = _rms(q), _rms(k)
        allowed = (j <= i) & (i - j <= window)  # the query, and the `window` tokens before it
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out = p @ v
        out[:, H - lap_heads :] = v[:, H - lap_heads :] - out[:, H - lap_heads :]
        x = x + a.o_proj(out.transpose(1, 2).reshape(B, T, H * D))
        hm = _rms(x)
        x = x + blk.mlp.fc2(torch.relu(blk.mlp.fc1(hm)).square())
    logits = m.lm_head(_rms(x))
    return 15.0 * torch.tanh(logits / 15.0)


def test_defaults_build_the_stock_nanochat():
    """No value embeddings and an all-L pattern (also one that only the last layer would take) is transformers'
    own class and config, with nothing new in config.json."""
    for kw in ({}, {"window_pattern": "LLL"}, {"depth": 1, "window_pattern": "S"}):
        cfg = LMModelConfig(**{"depth": 2, "width": 32, "n_heads": 4, **kw})
        m = build_model(cfg, V, 64)
        assert type(m) is NanoChatForCausalLM and type(m.config) is NanoChatConfig, kw
        d = m.config.to_dict()
        assert d["model_type"] == "nanochat"
        assert not {"layer_types", "sliding_window", "value_embedding_layers"} & set(d)


def test_window_rule_matches_nanochat():
    assert window_layer_types("SSSL", 6) == ["sliding_attention"] * 3 + ["full_attention", "sliding_attention"] + [
        "full_attention"
    ]  # tiled, and the last layer always full
    assert default_short_window(2048) == 512 and default_short_window(1000) == 256 and default_short_window(64) == 128
    m = build_model(LMModelConfig(depth=4, width=32, n_heads=4, window_pattern="SL"), V, 2048)
    assert m.config.sliding_window == 513  # transformers counts the query itself
    m = build_model(LMModelConfig(depth=5, width=32, n_heads=4, value_embeddings=True), V, 64)
    assert sorted(m.model.value_embeds) == ["0", "2", "4"]  # every other layer, the last included
    assert [la.self_attn.ve_gate is not None for la in m.model.layers] == [True, False, True, False, True]


@pytest.mark.parametrize("heads", [0, 2, 4])
def test_forward_matches_an_explicit_reference(heads):
    m = _model(laplacian_heads=heads)
    ids = torch.randint(0, V, (2, 12))
    want = _reference_logits(m, ids, [4, 4, 4, 64], heads, {1, 3})
    assert torch.allclose(m(input_ids=ids).logits, want, atol=1e-10, rtol=0)
    # the eager implementation (the operator as an explicit matrix) gives the same
    m.set_attn_implementation(lap_tf.EAGER_ATTN_IMPLEMENTATION)
    assert torch.allclose(m(input_ids=ids).logits, want, atol=1e-10, rtol=0)


def test_the_window_and_the_value_embeddings_change_the_model():
    """The reference above cannot pass by accident: the same weights without the window or without the
    value embeddings give other logits."""
    m = _model()
    ids = torch.randint(0, V, (1, 12))
    got = m(input_ids=ids).logits
    assert not torch.allclose(got, _reference_logits(m, ids, [64] * 4, 2, {1, 3}), atol=1e-4)
    assert not torch.allclose(got, _reference_logits(m, ids, [4, 4, 4, 64], 2, set()), atol=1e-4)


def test_kv_cache_decoding_is_exact_with_sliding_windows():
    """Prefill then one token at a time through transformers' DynamicCache (its sliding layers keep only the
    window) gives the logits of the full pass, well past the window."""
    m = _model(laplacian_heads=2)
    ids = torch.randint(0, V, (2, 20))
    full = m(input_ids=ids, use_cache=False).logits
    cache = DynamicCache(config=m.config)
    steps = [m(input_ids=ids[:, :5], cache=cache, use_cache=True).logits]
    for t in range(5, 20):
        steps.append(m(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    assert isinstance(cache.layers[0], DynamicSlidingWindowLayer) and cache.layers[0].keys.shape[-2] == 4
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-10, rtol=0)
    # generate() (KV-cached, greedy) continues as the uncached greedy loop does
    prompt = ids[:1, :3]
    got = m.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    seq = prompt
    for _ in range(12):
        nxt = m(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(got, seq)


def test_value_embeddings_need_token_ids():
    m = _model()
    with pytest.raises(ConfigError, match="input_ids"):
        m(inputs_embeds=m.model.embed_tokens(torch.randint(0, V, (1, 4))))


def test_bad_window_pattern_is_one_line():
    with pytest.raises(ConfigError, match=r"model\.window_pattern='SXL'.*L \(full context\) and S"):
        load_config(R.LMConfig, None, ["model.window_pattern=SXL"])


def test_save_and_load_keep_the_architecture(tmp_path):
    from lapheads.lm.tokenizer import train_tokenizer

    tok = train_tokenizer(["the cat sat on the mat " * 40], 300, tmp_path / "tok")
    torch.manual_seed(0)
    m = build_model(
        LMModelConfig(depth=3, width=32, n_heads=4, laplacian_heads=1, value_embeddings=True, window_pattern="SL"),
        len(tok),
        64,
    )
    R.export_hf(m, tok, tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["model_type"] == "lapheads_nanochat" and saved["layer_types"][-1] == "full_attention"
    loaded, _ = R.load_model(tmp_path / "hf")
    assert type(loaded) is LapNanoChatForCausalLM
    ids = torch.randint(0, len(tok), (1, 10))
    assert torch.equal(m.eval()(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_optimizer_groups_and_parameter_counts():
    cfg = LMModelConfig(depth=4, width=64, n_heads=2, value_embeddings=True, window_pattern="SL", short_window=8)
    m = build_model(cfg, V, 64)
    g = param_groups(m)
    ids = [id(p) for ps in g.values() for _, p in ps]
    assert len(ids) == len(set(ids)) == len(list(m.parameters()))
    assert sorted(n for n, _ in g["value_embedding"]) == ["model.value_embeds.1.weight", "model.value_embeds.3.weight"]
    assert {n for n, _ in g["matrix"] if "ve_gate" in n} == {
        f"model.layers.{i}.self_attn.ve_gate.weight" for i in (1, 3)
    }
    adamw, _ = build_optimizers(m, LMOptimConfig(value_embedding_lr=0.15))
    lrs = {gr["name"]: gr["lr"] for gr in adamw.param_groups}
    assert lrs["value_embedding"] == pytest.approx(0.15 * (64 / 768) ** -0.5)
    w, d, heads = 64, 4, 2
    blocks = d * (4 * w * w + 2 * 4 * w * w) + 2 * 12 * heads  # q k v o, fc1 fc2; two gates of 12 x heads
    assert budget_params(m, "scaling") == blocks + V * w  # + lm_head
    assert budget_params(m, "all") == count_params(m) == blocks + 2 * V * w + 2 * V * w  # + embedding, 2 VEs
    assert count_params(m, exclude_embedding=True) == blocks + V * w
    keys = 9 + 64 + 9 + 64  # layers S L S L: a window of 8 tokens before the query, and the query
    assert flops_per_token(m, 64) == 6.0 * (blocks + V * w) + 12.0 * heads * 32 * keys


def test_learnable_mixing_and_activation_checkpointing_with_both_features():
    """Learnable head mixing registers on the new attention modules, and recomputing the blocks in backward
    (value embeddings handed to them as arguments) gives the gradients of the plain backward."""
    from lapheads.engine.fsdp import enable_activation_checkpointing, transformer_blocks

    m = _model(laplacian_heads="learn:laplacian").float().train()
    assert len(param_groups(m)["mix"]) == 2 * 4 and len(transformer_blocks(m)) == 4
    ids = torch.randint(0, V, (2, 12))

    def grads():
        m.zero_grad()
        m(input_ids=ids, use_cache=False).logits.square().mean().backward()
        return [p.grad.clone() for p in m.parameters()]

    plain = grads()
    enable_activation_checkpointing(m)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads()))
