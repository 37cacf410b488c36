"""torch.compile sees no graph break in a timm ViT or a Hugging Face Llama with grouped-query attention,
for no Laplacian head, trailing k, all heads and learnable mixing; fullgraph=True compiles them and
gives the eager outputs and gradients."""

from __future__ import annotations

import pytest
import torch

SPECS = [0, 3, "all", "learn:laplacian"]


def _vit(spec):
    import lapheads.timm as lt

    torch.manual_seed(0)
    return lt.create_model(
        "vit_tiny_patch16_224", laplacian_heads=spec, img_size=32, patch_size=8, depth=2, embed_dim=48, num_heads=6
    )


def _llama(spec):
    from transformers import LlamaConfig, LlamaForCausalLM

    import lapheads.transformers as ltr

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=50,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg)
    ltr.enable(model, spec)
    return model


MODELS = {
    "timm-vit": (_vit, lambda: torch.randn(2, 3, 32, 32), lambda m, x: m(x)),
    "hf-llama-gqa": (
        _llama,
        lambda: torch.randint(0, 50, (2, 12)),
        lambda m, x: m(input_ids=x, use_cache=False).logits,
    ),
}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("name", list(MODELS))
def test_no_graph_break(name, spec):
    build, data, call = MODELS[name]
    model, x = build(spec), data()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda x: call(model, x))(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("spec", [3, "learn:laplacian"])
@pytest.mark.parametrize("name", list(MODELS))
def test_fullgraph_compile_matches_eager_with_gradients(name, spec):
    build, data, call = MODELS[name]
    model, x = build(spec), data()
    eager = call(model, x)
    eager.square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: call(model, x), backend="aot_eager", fullgraph=True)
    got = compiled(x)
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)
    got.square().mean().backward()
    assert want.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if n in want:
            torch.testing.assert_close(p.grad, want[n], atol=1e-5, rtol=1e-4, msg=n)
    if spec == "learn:laplacian":
        assert any(n.endswith("lap_mix_a") for n in want)  # the mixing parameters got gradients
