"""Models with Laplacian heads survive every exporter: jit.trace, torch.export, and ONNX (the
TorchScript exporter and the dynamo exporter, run in onnxruntime).

Each model is tiny (2 layers, width 32, 4 heads). Every check compares the exported program with
the eager model, and first makes sure the Laplacian model's output is far from the same weights'
k = 0 output, so an exporter that silently dropped the heads (the bug this file guards against:
``enable_gqa`` got a tensor under tracing) could not pass.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from timm.layers import Attention
from timm.models.vision_transformer import VisionTransformer
from transformers import NanoChatConfig, NanoChatForCausalLM

import lapheads.timm as ltimm
import lapheads.transformers as ltr
from lapheads.nn import MultiheadAttention

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # the dynamo exporter's translator

EXPORTERS = ["jit.trace", "torch.export", "onnx-torchscript", "onnx-dynamo"]
ATOL = 1e-5


# ----------------------------------------------------------------------------- models
def _vit(heads, fused: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5).eval()
    ltimm.convert(model, heads)
    for m in model.modules():
        if isinstance(m, Attention):
            m.fused_attn = fused
    return model


class _LogitsOnly(torch.nn.Module):
    """NanoChat as ``(input_ids, attention_mask) -> logits`` (exporters want tensors in, tensors out)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def _nanochat(heads) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = NanoChatConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        initializer_range=0.2,
    )
    model = NanoChatForCausalLM(cfg).eval()
    if heads:
        ltr.enable(model, heads)
    return _LogitsOnly(model)


def _encoder(heads) -> torch.nn.Module:
    """torch's TransformerEncoderLayer with lapheads' MultiheadAttention as self_attn."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    layer.self_attn = MultiheadAttention.from_torch(layer.self_attn, heads)
    return layer.eval()


def _lm_inputs(t: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 97, (2, t), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, t, dtype=torch.long)
    mask[1, :2] = 0  # left padding: two queries of row 1 see no key at all (P = 0 there)
    return ids, mask


CASES = {
    # name: (model factory taking the head selection, example inputs)
    "vit-fused": (lambda h: _vit(h, fused=True), lambda: (torch.randn(2, 3, 16, 16),)),
    "vit-eager": (lambda h: _vit(h, fused=False), lambda: (torch.randn(2, 3, 16, 16),)),
    "vit-per-layer": (lambda h: _vit([[3], [0, 1, 2, 3]] if h else 0), lambda: (torch.randn(2, 3, 16, 16),)),
    "nanochat": (_nanochat, _lm_inputs),
    "torch-encoder": (_encoder, lambda: (torch.randn(2, 6, 32),)),
}


# ----------------------------------------------------------------------------- exporters
def _export_and_run(model: torch.nn.Module, args: tuple, exporter: str, tmp_path) -> torch.Tensor:
    """Export ``model`` with ``exporter``, run the exported program on ``args``, return its output."""
    if exporter == "jit.trace":
        with warnings.catch_warnings():
            # TracerWarning: shapes are recorded as constants; FutureWarning: jit.trace is deprecated.
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(model, args)
        return traced(*args)
    if exporter == "torch.export":
        return torch.export.export(model, args).module()(*args)
    path = str(tmp_path / "model.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, path, dynamo=exporter == "onnx-dynamo")
    onnx.checker.check_model(path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    return torch.from_numpy(session.run(None, feeds)[0])


# The dynamo ONNX exporter is torch.export plus a translation (seconds each): run it on one model of
# each family; torch.export covers the other variants.
PAIRS = [
    (c, e) for c in CASES for e in EXPORTERS if not (e == "onnx-dynamo" and c in ("vit-per-layer", "torch-encoder"))
]


@pytest.mark.parametrize("case,exporter", PAIRS)
def test_exported_laplacian_model_equals_eager(case, exporter, tmp_path):
    make, inputs = CASES[case]
    model, baseline = make(2), make(0)
    args = inputs()
    with torch.no_grad():
        # Export first: a fresh model must export (no state cached by an earlier eager call).
        got = _export_and_run(model, args, exporter, tmp_path)
        want = model(*args)
        assert (want - baseline(*args)).abs().max() > 100 * ATOL  # the heads change the output
    assert got.shape == want.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_torch_export_nanochat_with_a_dynamic_sequence_length():
    """One exported program serves every length: the heads' bookkeeping must not pin the example's size."""
    model = _nanochat(2)
    seq = torch.export.Dim("seq", min=2, max=64)
    program = torch.export.export(model, _lm_inputs(7), dynamic_shapes=({1: seq}, {1: seq}))
    for t in (4, 12):
        args = _lm_inputs(t)
        with torch.no_grad():
            torch.testing.assert_close(program.module()(*args), model(*args), atol=ATOL, rtol=1e-4)


def test_torch_export_vit_with_a_dynamic_batch():
    model = _vit(3)
    batch = torch.export.Dim("batch", min=1, max=16)
    program = torch.export.export(model, (torch.randn(2, 3, 16, 16),), dynamic_shapes=({0: batch},))
    x = torch.randn(5, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), model(x), atol=ATOL, rtol=1e-4)


# ----------------------------------------------------------------------------- learnable mixing
LEARN_CASES = {
    "vit-fused": (lambda: _vit("learn:2", fused=True), CASES["vit-fused"][1]),
    "vit-eager": (lambda: _vit("learn:2", fused=False), CASES["vit-eager"][1]),
    "nanochat": (lambda: _nanochat("learn:2"), _lm_inputs),
    "torch-encoder": (lambda: _encoder("learn:2"), CASES["torch-encoder"][1]),
}
LEARN_PAIRS = [
    (c, e) for c in LEARN_CASES for e in EXPORTERS if not (e == "onnx-dynamo" and c in ("vit-eager", "torch-encoder"))
]


def _set_learned(model: torch.nn.Module) -> None:
    """Move every layer's (a, b) away from its initialisation, as training would."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lap_mix_a"):
                p.copy_(torch.tensor([0.6, -0.4, 1.3, 0.2]))
            elif name.endswith("lap_mix_b"):
                p.copy_(torch.tensor([0.5, 1.4, -0.7, 0.9]))


@pytest.mark.parametrize("case,exporter", LEARN_PAIRS)
def test_exported_learnable_model_keeps_the_learned_mixing(case, exporter, tmp_path):
    make, inputs = LEARN_CASES[case]
    model, at_init = make(), make()
    _set_learned(model)
    args = inputs()
    with torch.no_grad():
        got = _export_and_run(model, args, exporter, tmp_path)
        want = model(*args)
        # the learned values change the output, so an export that kept the initial (a, b) would fail
        assert (want - at_init(*args)).abs().max() > 100 * ATOL
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
