"""Laplacian heads inside other people's training loops (docs/other-trainers.md).

* a transformers model (tiny random Llama and NanoChat configs) with learnable head mixing under
  ``transformers.Trainer``: train, checkpoint, resume from the checkpoint (the resumed run's
  weights equal the uninterrupted run's), evaluate, save, and reload as Laplacian with
  :func:`lapheads.transformers.from_pretrained` (the same logits);
* a timm ViT with Laplacian heads (:func:`lapheads.timm.create_model`) under a plain
  ``accelerate`` loop: ``save_state`` / ``load_state`` resume exactly, and the saved weights load
  back into a freshly created Laplacian model with the same logits.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import lapheads.transformers as LT  # noqa: E402
from lapheads.transformers import MIX_PARAM_SUFFIXES  # noqa: E402


def _tiny(kind: str):
    torch.manual_seed(0)
    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **common))
    else:
        model = transformers.NanoChatForCausalLM(transformers.NanoChatConfig(num_key_value_heads=4, **common))
    return LT.enable(model, "learn:2")  # before the Trainer builds its optimizer: the mixing is trained too


def _args(out, **kw):
    return transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        learning_rate=1e-2,
        seed=0,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        **kw,
    )


@pytest.mark.parametrize("kind", ["llama", "nanochat"])
def test_hf_trainer_trains_resumes_evaluates_and_reloads_as_laplacian(kind, tmp_path):
    ids = torch.randint(0, 64, (24, 16), generator=torch.Generator().manual_seed(1))
    train = [{"input_ids": x, "labels": x} for x in ids[:16]]
    held_out = [{"input_ids": x, "labels": x} for x in ids[16:]]

    model = _tiny(kind)
    mix0 = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(MIX_PARAM_SUFFIXES)}
    assert len(mix0) == 4
    full = transformers.Trainer(model=model, args=_args(tmp_path / "full"), train_dataset=train)
    full.train()
    assert sorted(p.name for p in (tmp_path / "full").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    saved = json.loads((tmp_path / "full" / "checkpoint-2" / "config.json").read_text())
    assert saved["laplacian_heads"] == "learn:2" and saved["attn_implementation"].startswith("laplacian_sdpa")
    assert any(not torch.equal(p, mix0[n]) for n, p in model.named_parameters() if n in mix0)  # mixing learned

    resumed = transformers.Trainer(
        model=_tiny(kind), args=_args(tmp_path / "resumed"), train_dataset=train, eval_dataset=held_out
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # exact resume
    metrics = resumed.evaluate()
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))

    resumed.save_model(str(tmp_path / "final"))
    reloaded = LT.from_pretrained(str(tmp_path / "final"), type(resumed.model))
    assert reloaded.config._attn_implementation == "laplacian_sdpa"
    mix = {n: p for n, p in reloaded.named_parameters() if n.endswith(MIX_PARAM_SUFFIXES)}
    assert mix.keys() == mix0.keys() and all(torch.equal(p, b[n]) for n, p in mix.items())
    x = ids[16:20]
    resumed.model.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, resumed.model(x).logits)


def test_timm_model_under_a_plain_accelerate_loop(tmp_path):
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from safetensors.torch import load_file, save_file

    import lapheads.timm as LTM

    kw = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=3)
    x = torch.randn(48, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    y = torch.arange(48) % 3

    def run(steps: int, save_at: int, resume: bool = False):
        set_seed(0)
        acc = Accelerator(cpu=True)
        model = LTM.create_model("vit_tiny_patch16_224", laplacian_heads=2, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
        model, opt, data = acc.prepare(model, opt, data)
        start = 0
        if resume:  # accelerate's checkpoint: model, optimizer and RNG states; the loader skips what was seen
            acc.load_state(str(tmp_path / "state"))
            start, data = save_at, acc.skip_first_batches(data, save_at)
        for step, (xb, yb) in enumerate(data, start=start):
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            if step + 1 == save_at and not resume:
                acc.save_state(str(tmp_path / "state"))
            if step + 1 == steps:
                break
        return acc.unwrap_model(model)

    full = run(6, save_at=3)
    assert LTM.laplacian_head_counts(full) == [2, 2]
    resumed = run(6, save_at=3, resume=True)
    a, b = full.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(tmp_path / "vit.safetensors"))
    fresh = LTM.create_model("vit_tiny_patch16_224", laplacian_heads=2, **kw)
    fresh.load_state_dict(load_file(str(tmp_path / "vit.safetensors")))
    full.eval()
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(x[:4]), full(x[:4]))
