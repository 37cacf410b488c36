"""lapheads.transformers: registered Laplacian attention for NanoChat, Llama, Qwen3 and GPT-2.

Every model is tiny (hidden 32, 2 layers, vocab 97) and runs in float64 so greedy decoding has no
near-ties and the comparisons can be exact or at 1e-10.
"""

from __future__ import annotations

import math

import pytest
import torch
from _lm_helpers import greedy_by_recompute
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    NanoChatConfig,
    NanoChatForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import lapheads.transformers as lt
from lapheads import ConfigError

V = 97


def _config(arch: str, **kw):
    if arch == "nanochat":
        return NanoChatConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            **kw,
        )
    if arch == "llama":  # grouped-query attention: 4 query heads over 2 KV heads
        return LlamaConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            **kw,
        )
    if arch == "qwen3":
        return Qwen3Config(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            **kw,
        )
    if arch == "gpt2":
        return GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, **kw)
    raise AssertionError(arch)


_CLASSES = {
    "nanochat": NanoChatForCausalLM,
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gpt2": GPT2LMHeadModel,
}
ARCHS = list(_CLASSES)


def _model(arch: str, heads=None, impl: str = "sdpa", **kw):
    torch.manual_seed(0)
    cfg = _config(arch, **kw)
    model = _CLASSES[arch](cfg).double().eval()
    if heads is not None:
        lt.enable(model, heads)
    elif impl != "sdpa":
        model.set_attn_implementation(impl)
    # No early stop: generation must run all the steps we compare.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _clone(model, impl: str, heads=None):
    """A second model with the same weights and another attention implementation."""
    other = type(model)(model.config.__class__(**model.config.to_dict())).double().eval()
    other.load_state_dict(model.state_dict())
    if heads is not None:
        other.config.laplacian_heads = heads
    other.set_attn_implementation(impl)
    other.generation_config.eos_token_id = None
    other.generation_config.pad_token_id = 0
    return other


# --------------------------------------------------------------------------- an independent reference
# Written from the paper's formula, not from lapheads: explicit P per head, (I - P) V for the heads the
# TEST picks for each layer index (trailing k), values of the query's own position = last Tq keys.
_REF_HEADS: dict[int, int] = {}


def _manual_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    h, hkv = query.shape[1], key.shape[1]
    key = key.repeat_interleave(h // hkv, dim=1)
    value = value.repeat_interleave(h // hkv, dim=1)
    tq, tk = query.shape[2], key.shape[2]
    scale = scaling if scaling is not None else 1 / math.sqrt(query.shape[-1])
    scores = query @ key.transpose(-1, -2) * scale
    if attention_mask is not None:
        scores = scores + attention_mask
    p = torch.softmax(scores, dim=-1)
    out = p @ value
    k = _REF_HEADS.get(module.layer_idx, 0)
    if k:
        own = value[:, :, tk - tq :, :]
        out = torch.cat([out[:, : h - k], own[:, h - k :] - out[:, h - k :]], dim=1)
    return out.transpose(1, 2).contiguous(), p


AttentionInterface.register("test_manual_laplacian", _manual_attention)
AttentionMaskInterface.register("test_manual_laplacian", eager_mask)


def _left_padded(rng_seed: int = 1):
    g = torch.Generator().manual_seed(rng_seed)
    ids = torch.randint(3, V, (2, 9), generator=g)
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, :3] = 0  # second row is left-padded by three tokens
    ids[1, :3] = 0
    return ids, am


# --------------------------------------------------------------------------- tests
def test_registration_names():
    for name in (
        lt.ATTN_IMPLEMENTATION,
        lt.FUSED_ATTN_IMPLEMENTATION,
        lt.EAGER_ATTN_IMPLEMENTATION,
        lt.SAVED_ATTN_IMPLEMENTATION,
        lt.SAVED_FUSED_ATTN_IMPLEMENTATION,
        lt.SAVED_EAGER_ATTN_IMPLEMENTATION,
    ):
        assert name in AttentionInterface._global_mapping and name in AttentionMaskInterface._global_mapping
    # the fused twin's name claims no built-in backend, so transformers' SDPA-support check never sees it
    assert "sdpa" not in lt.FUSED_ATTN_IMPLEMENTATION and "flash" not in lt.FUSED_ATTN_IMPLEMENTATION
    assert AttentionInterface._global_mapping[lt.FUSED_ATTN_IMPLEMENTATION] is lt.laplacian_sdpa_attention_forward
    # the name saved for a model that needs indexing is registered too: a plain load refuses its first
    # forward with one line naming the fix (tests/test_transformers_coverage.py), not transformers' list
    indexed = lt.ATTN_IMPLEMENTATION + lt.INDEXED_ATTN_IMPLEMENTATION_SUFFIX
    assert indexed in AttentionInterface._global_mapping and lt.is_laplacian_implementation(indexed)
    assert "lapheads.transformers.from_pretrained" in indexed


@pytest.mark.parametrize("arch", ARCHS)
def test_decoders_stay_plain_loadable(arch):
    """A decoder's modules carry their stack index as layer_idx: the saved name is the registered alias."""
    model = _model(arch, [1, 3])
    assert model.config.to_dict()["attn_implementation"] == lt.SAVED_ATTN_IMPLEMENTATION
    attn = [m for m in lt.mixing_modules(model)]
    assert [m.laplacian_layer for m in attn] == [m.layer_idx for m in attn] == [0, 1]


@pytest.mark.parametrize("arch", ARCHS)
def test_integration_equals_manual_reference(arch):
    heads = [1, 3]  # different per layer, so reading the wrong layer_idx would fail
    model = _model(arch, heads)
    ids, am = _left_padded()
    _REF_HEADS.clear()
    _REF_HEADS.update({0: 1, 1: 3})
    ref = _clone(model, "test_manual_laplacian")
    got = model(ids, attention_mask=am).logits
    want = ref(ids, attention_mask=am).logits
    real = am.bool()  # padded positions are garbage in every implementation; compare real tokens
    assert torch.allclose(got[real], want[real], atol=1e-10, rtol=0), (got - want)[real].abs().max()
    # ... and the Laplacian heads really changed the model (the check above can fail).
    stock = _clone(model, "sdpa", heads=0)(ids, attention_mask=am).logits
    assert (got[real] - stock[real]).abs().max() > 1e-3
    # Gradients flow through the fused path.
    model.train()
    model(ids, attention_mask=am, labels=ids).loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_explicit_head_indices(arch):
    model = _model(arch, [[0, 2], []])
    ids, am = _left_padded()
    sels = lt.layer_selections(model.config)
    assert sels[0].indices == (0, 2) and not sels[1].any
    eager = _clone(model, lt.EAGER_ATTN_IMPLEMENTATION)
    out = eager(ids, attention_mask=am, output_attentions=True)
    row_sums = out.attentions[0][0].sum(-1)  # batch row 0 has no padding
    assert torch.allclose(row_sums[[0, 2]], torch.zeros_like(row_sums[[0, 2]]), atol=1e-12)
    assert torch.allclose(row_sums[[1, 3]], torch.ones_like(row_sums[[1, 3]]), atol=1e-12)
    real = am.bool()
    assert torch.allclose(model(ids, attention_mask=am).logits[real], out.logits[real], atol=1e-10, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_zero_heads_equals_stock_sdpa(arch):
    model = _model(arch, 0)
    assert model.config._attn_implementation == lt.ATTN_IMPLEMENTATION
    ids, am = _left_padded()
    stock = _clone(model, "sdpa", heads=0)
    assert torch.equal(model(ids, attention_mask=am).logits, stock(ids, attention_mask=am).logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_with_kv_cache_equals_full_recompute(arch):
    model = _model(arch, "all" if arch == "gpt2" else 2)
    prompt = torch.randint(3, V, (1, 5), generator=torch.Generator().manual_seed(3))
    n_new = 8
    gen = model.generate(prompt, max_new_tokens=n_new, do_sample=False)
    seq = greedy_by_recompute(model, prompt, n_new)
    assert torch.equal(gen, seq)
    # The cache path itself (not just argmax) agrees: logits of the last step.
    with torch.no_grad():
        out = model(seq[:, :-1], use_cache=True)
        step = model(seq[:, -1:], cache=out.past_key_values).logits[:, -1]
        full = model(seq).logits[:, -1]
    assert torch.allclose(step, full, atol=1e-10, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_left_padding_generation(arch):
    model = _model(arch, 2)
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(3, V, (1, 7), generator=g), torch.randint(3, V, (1, 4), generator=g)
    batch = torch.zeros(2, 7, dtype=torch.long)
    am = torch.zeros(2, 7, dtype=torch.long)
    batch[0], am[0] = a[0], 1
    batch[1, 3:], am[1, 3:] = b[0], 1
    n_new = 6
    together = model.generate(batch, attention_mask=am, max_new_tokens=n_new, do_sample=False)
    alone_a = model.generate(a, max_new_tokens=n_new, do_sample=False)
    alone_b = model.generate(b, max_new_tokens=n_new, do_sample=False)
    assert torch.equal(together[0, -n_new:], alone_a[0, -n_new:])
    assert torch.equal(together[1, -n_new:], alone_b[0, -n_new:])


@pytest.mark.parametrize("arch", ["nanochat", "llama"])
def test_static_cache_is_refused(arch):
    model = _model(arch, 1)
    prompt = torch.randint(3, V, (1, 5))
    with pytest.raises(ConfigError, match="static"):
        model.generate(prompt, max_new_tokens=3, do_sample=False, cache_implementation="static")
    # Without Laplacian heads the stock path serves a static cache as before.
    lt.enable(model, 0)
    out = model.generate(prompt, max_new_tokens=3, do_sample=False, cache_implementation="static")
    assert out.shape == (1, 8)


def test_preallocated_buffer_refused_in_attention_function():
    """A 4D mask built by the user bypasses the mask function; the attention function still refuses."""
    model = _model("llama", 1)
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 10, 8, dtype=torch.float64)  # 10 slots, only 5 + 2 filled
    mask = torch.zeros(1, 1, 2, 10, dtype=torch.bool)
    mask[..., :6] = True
    mask[..., 1, 6] = True
    with pytest.raises(ConfigError, match="static"):
        lt.laplacian_sdpa_attention_forward(attn, q, k, k.clone(), mask)
    with pytest.raises(ConfigError, match="static"):  # empty static prefill: no mask, Tk > Tq > 1
        lt.laplacian_sdpa_attention_forward(attn, q, k, k.clone(), None)
    mask[..., :] = True  # a cache that ends at the newest query is fine
    out, _ = lt.laplacian_sdpa_attention_forward(attn, q, k, k.clone(), mask)
    assert out.shape == (1, 2, 4, 8)


def test_sliding_window_layers_decode_like_full_recompute():
    model = _model(
        "qwen3", [2, 1], use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    )
    prompt = torch.randint(3, V, (1, 6), generator=torch.Generator().manual_seed(5))
    gen = model.generate(prompt, max_new_tokens=6, do_sample=False)
    seq = greedy_by_recompute(model, prompt, 6)
    assert torch.equal(gen, seq)


@pytest.mark.parametrize("arch", ["nanochat", "gpt2"])
def test_eager_returns_operator(arch):
    model = _model(arch, 2)
    ids = torch.randint(3, V, (2, 6))
    eager = _clone(model, lt.EAGER_ATTN_IMPLEMENTATION)
    out = eager(ids, output_attentions=True)
    assert len(out.attentions) == 2
    op = out.attentions[0]
    assert op.shape == (2, 4, 6, 6)
    sums = op.sum(-1)
    assert torch.allclose(sums[:, 2:], torch.zeros_like(sums[:, 2:]), atol=1e-12)  # I - P
    assert torch.allclose(sums[:, :2], torch.ones_like(sums[:, :2]), atol=1e-12)  # P
    assert torch.all(op[:, :2].triu(1) == 0)  # causal
    # The first token of a Laplacian head gets exactly zero: row 0 of I - P is 0.
    assert torch.all(op[:, 2:, 0] == 0)
    assert torch.allclose(out.logits, model(ids).logits, atol=1e-10, rtol=0)


def test_save_and_load_round_trip(tmp_path):
    model = _model("nanochat", [1, 4])
    model.save_pretrained(tmp_path)
    loaded = lt.from_pretrained(str(tmp_path), dtype=torch.float64)
    assert loaded.config.laplacian_heads == [1, 4]
    assert loaded.config._attn_implementation == lt.ATTN_IMPLEMENTATION
    ids = torch.randint(3, V, (1, 6))
    assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)
    explicit = AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation=lt.ATTN_IMPLEMENTATION, dtype=torch.float64
    )
    assert torch.equal(explicit.eval()(ids).logits, model(ids).logits)


def test_enable_on_config_and_validation():
    cfg = _config("llama")
    lt.enable(cfg, 3)
    assert cfg.laplacian_heads == 3 and cfg._attn_implementation == lt.ATTN_IMPLEMENTATION
    model = LlamaForCausalLM(cfg)
    assert model.config._attn_implementation == lt.ATTN_IMPLEMENTATION
    with pytest.raises(ConfigError, match="only 4 heads"):
        lt.enable(model, 5)
    assert model.config.laplacian_heads == 3  # a refused spec leaves the old one in place
    with pytest.raises(ConfigError, match="per-layer entries"):
        lt.enable(model, [1, 1, 1])
    with pytest.raises(ConfigError):
        lt.enable(object(), 1)
    # A spec edited by hand after enable() is validated at the first forward.
    model.config.laplacian_heads = 9
    with pytest.raises(ConfigError, match="only 4 heads"):
        model(torch.randint(0, V, (1, 4)))


# --------------------------------------------------------------------------- plain transformers loaders
@pytest.fixture(scope="module")
def laplacian_checkpoint(tmp_path_factory):
    """A save_pretrained directory (float64 NanoChat with [1, 4] Laplacian heads + a tokenizer)."""
    from lapheads.lm.tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("lap_ckpt")
    tok = train_tokenizer(["the list type is a mutable sequence; a tuple is not. " * 20], 300, path)
    torch.manual_seed(0)
    cfg = NanoChatConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        bos_token_id=tok.bos_token_id,
        pad_token_id=None,
    )
    model = NanoChatForCausalLM(cfg).double().eval()
    lt.enable(model, [1, 4])
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    return path, model, tok


def test_config_json_names_the_laplacian_implementation(laplacian_checkpoint, tmp_path):
    import json

    path, model, _ = laplacian_checkpoint
    saved = json.loads((path / "config.json").read_text())
    assert saved["laplacian_heads"] == [1, 4]
    assert saved["attn_implementation"] == lt.SAVED_ATTN_IMPLEMENTATION
    assert "import lapheads.transformers" in lt.SAVED_ATTN_IMPLEMENTATION
    # The eager twin is saved as eager once it has run (set_attn_implementation is transformers' alone);
    # a model without Laplacian heads saves no implementation.
    eager = _clone(model, lt.EAGER_ATTN_IMPLEMENTATION)
    eager(torch.tensor([[1, 2, 3]]))
    assert eager.config.to_dict()["attn_implementation"] == lt.SAVED_EAGER_ATTN_IMPLEMENTATION
    plain = _model("nanochat")
    plain.save_pretrained(tmp_path / "plain")
    assert "attn_implementation" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    lt.enable(plain, 0)
    assert "attn_implementation" not in plain.config.to_dict()


def test_marking_changes_one_config_not_transformers_classes(laplacian_checkpoint, tmp_path):
    """No patch: enable() marks its own config instance (a plain attribute, the config keeps its class);
    a config of the same transformers class built beside it saves no implementation key even with
    laplacian_heads set, and the class's own to_dict is transformers' (nothing else in the process changes)."""
    import copy
    import json
    import pickle

    from transformers import PreTrainedConfig

    path, model, _ = laplacian_checkpoint
    base = type(model.config)
    assert base.__module__.startswith("transformers.") and base.__post_init__.__module__.startswith("transformers.")
    assert base.to_dict is PreTrainedConfig.to_dict or "lapheads" not in base.to_dict.__module__
    other = base(**{k: v for k, v in model.config.to_dict().items() if k != "attn_implementation"})
    assert type(other) is base and other.laplacian_heads == [1, 4]
    assert "attn_implementation" not in other.to_dict()  # unmarked: plain transformers behaviour
    assert lt.mark_config(other) is other and other.to_dict()["attn_implementation"] == lt.SAVED_ATTN_IMPLEMENTATION
    assert type(other).__name__ == base.__name__ and isinstance(other, base)
    for twin in (copy.deepcopy(other), pickle.loads(pickle.dumps(other))):
        assert twin.to_dict()["attn_implementation"] == lt.SAVED_ATTN_IMPLEMENTATION
        assert twin.laplacian_heads == [1, 4]
    # transformers' auto classes still recognise a marked config
    from transformers import AutoModelForCausalLM as Auto

    built = Auto.from_config(other)
    assert built.config.to_dict()["attn_implementation"] == lt.SAVED_ATTN_IMPLEMENTATION
    built.save_pretrained(tmp_path / "built")
    assert (
        json.loads((tmp_path / "built" / "config.json").read_text())["attn_implementation"]
        == lt.SAVED_ATTN_IMPLEMENTATION
    )


def test_plain_auto_model_and_pipeline_get_the_laplacian_heads(laplacian_checkpoint, tmp_path):
    from transformers import pipeline

    path, model, tok = laplacian_checkpoint
    ids = torch.tensor([tok.encode("the list type is")])
    want = model(ids).logits
    auto = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    assert lt.is_laplacian_implementation(auto.config._attn_implementation)
    assert torch.equal(auto(ids).logits, want)
    assert torch.equal(lt.from_pretrained(str(path), dtype=torch.float64).eval()(ids).logits, want)
    # sanity: the same weights as standard attention are a different model
    assert not torch.allclose(_clone(model, "sdpa", heads=0)(ids).logits, want, atol=1e-6)
    pipe = pipeline("text-generation", model=str(path), dtype=torch.float64)
    assert torch.equal(pipe.model.eval()(ids).logits, want)
    text = pipe("the list type is", max_new_tokens=4, do_sample=False, return_full_text=False)[0]["generated_text"]
    gen = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=4,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=tok.pad_token_id,
    )
    assert text == tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
    # a model loaded the plain way and saved again keeps the key
    auto.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float64).eval()
    assert torch.equal(again(ids).logits, want)


def test_a_plain_load_saved_again_stays_laplacian(laplacian_checkpoint, tmp_path):
    """Loaded by transformers' own AutoModel / AutoConfig (lapheads imported) and saved again, with or without a
    forward pass: the copy is a checkpoint with Laplacian heads again (its config came from lapheads' registered
    model type, marked). A file that lost the implementation name (re-serialised by a tool without lapheads, with
    laplacian_heads kept) loads Laplacian through lapheads' loader, and a plain load of it refuses its first
    forward rather than run transformers' "sdpa" as the standard model."""
    import json

    from transformers import AutoConfig

    path, model, tok = laplacian_checkpoint
    ids = torch.tensor([tok.encode("a tuple is")])
    want = model(ids).logits
    ran = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    ran(ids)
    ran.save_pretrained(tmp_path / "ran")
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).save_pretrained(tmp_path / "copy")
    config = AutoConfig.from_pretrained(path)
    config.save_pretrained(tmp_path / "config_only")
    for d in ("ran", "copy", "config_only"):
        saved = json.loads((tmp_path / d / "config.json").read_text())
        assert saved["attn_implementation"] == lt.SAVED_ATTN_IMPLEMENTATION and saved["laplacian_heads"] == [1, 4], d
        assert saved["model_type"] == "lapheads-nanochat", d
    for d in ("ran", "copy"):
        again = AutoModelForCausalLM.from_pretrained(tmp_path / d, dtype=torch.float64).eval()
        assert torch.equal(again(ids).logits, want), d
    lost = json.loads((tmp_path / "copy" / "config.json").read_text())
    lost.update(model_type="nanochat", architectures=["NanoChatForCausalLM"])
    for key in ("attn_implementation", "auto_map", "transformers_weights"):
        del lost[key]
    (tmp_path / "copy" / "config.json").write_text(json.dumps(lost))
    copy = lt.from_pretrained(str(tmp_path / "copy"), dtype=torch.float64).eval()
    assert torch.equal(copy(ids).logits, want)
    # a plain load of that copy runs transformers' "sdpa", whose registered function refuses a config
    # with Laplacian heads in one line instead of computing the standard model silently
    plain_copy = AutoModelForCausalLM.from_pretrained(tmp_path / "copy", dtype=torch.float64).eval()
    assert plain_copy.config._attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match="lapheads.transformers.from_pretrained") as refused:
        plain_copy(ids)
    assert "\n" not in str(refused.value) and "laplacian_heads=[1, 4]" in str(refused.value)
    # the stock model itself (no Laplacian heads in its config) runs the stock function unchanged
    plain_copy.config.laplacian_heads = 0
    assert torch.equal(plain_copy(ids).logits, _clone(model, "sdpa", heads=0)(ids).logits)
    # a config that names no Laplacian implementation is not marked: its (stock) model is standard
    stock = type(model.config)(**{k: v for k, v in model.config.to_dict().items() if k != "attn_implementation"})
    assert "attn_implementation" not in stock.to_dict()
    # an explicit standard implementation is refused by the registered model type, like lt.from_pretrained
    with pytest.raises(ConfigError, match="laplacian_heads=0"):
        AutoConfig.from_pretrained(path, attn_implementation="sdpa")


def test_explicit_standard_implementation_is_refused(laplacian_checkpoint):
    path, model, tok = laplacian_checkpoint
    with pytest.raises(ConfigError, match="standard attention"):
        lt.from_pretrained(str(path), attn_implementation="sdpa")
    with pytest.raises(ConfigError, match="laplacian_heads=0"):
        lt.from_pretrained(str(path), attn_implementation="eager")
    # asking for the standard model on purpose: laplacian_heads=0 with any implementation
    ids = torch.tensor([tok.encode("a tuple")])
    std = lt.from_pretrained(str(path), laplacian_heads=0, attn_implementation="sdpa", dtype=torch.float64)
    assert std.config.laplacian_heads == 0
    assert torch.equal(std.eval()(ids).logits, _clone(model, "sdpa", heads=0)(ids).logits)
