"""Sharing a transformers checkpoint with Laplacian heads (docs/sharing.md).

* Plain transformers (a fresh interpreter that never imports lapheads) refuses the checkpoint on every path:
  the auto classes, ``pipeline`` and lm-eval's ``HFLM`` because its model type is unknown and its config is
  custom code, the concrete classes (``LlamaForCausalLM.from_pretrained``, with ``attn_implementation="eager"``
  / ``"sdpa"`` too) because of the weights name its config gives, and ``trust_remote_code=True`` without
  lapheads installed because of the loader file's import.
* With lapheads, ``lt.from_pretrained``, the auto classes, ``AutoConfig``, ``pipeline``, ``trust_remote_code``,
  PEFT and lm-eval give the Laplacian model: logits equal those of the same weights run through an attention
  written here from the formula (per head ``P V`` or ``V_self - P V``), not through lapheads' operator.
* A checkpoint of the format before this one (base ``model_type``, ``attn_implementation`` saved name) still
  loads, and saved again it is in the new format.
* The model card and its rules (a card the user wrote is kept), and ``push_to_hub`` with the Hub's HTTP calls
  recorded (nothing here reaches the Hub).

float64 throughout.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
import transformers as tf
import yaml
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import lapheads.transformers as lt
from lapheads import ConfigError

FIX = "this checkpoint has Laplacian heads"
CUSTOM_CODE = "trust_remote_code=True"
SPEC = [1, 4]  # Llama, 4 heads: layer 0 its last head, layer 1 all four
REF_HEADS = {0: {3}, 1: {0, 1, 2, 3}}  # SPEC written out by hand (trailing k of 4 heads)

#: Python lines that make ``import lapheads`` fail as if it were not installed (put first in a script).
NO_LAPHEADS = """
import importlib.abc, sys
class _NoLapheads(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "lapheads":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoLapheads())
"""


# --------------------------------------------------------------------------- a reference written from the formula
def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    h, hkv = query.shape[1], key.shape[1]
    key = key.repeat_interleave(h // hkv, dim=1)
    value = value.repeat_interleave(h // hkv, dim=1)
    tq, tk = query.shape[2], key.shape[2]
    scale = scaling if scaling is not None else 1 / math.sqrt(query.shape[-1])
    scores = query @ key.transpose(-1, -2) * scale
    if attention_mask is not None:
        scores = scores + attention_mask
    pv = torch.softmax(scores, dim=-1) @ value
    own = value[:, :, tk - tq :, :]
    lap = torch.tensor([i in REF_HEADS[module.layer_idx] for i in range(h)]).view(1, h, 1, 1)
    return torch.where(lap, own - pv, pv).transpose(1, 2).contiguous(), None


AttentionInterface.register("test_sharing_reference", _reference_attention)
AttentionMaskInterface.register("test_sharing_reference", eager_mask)


def _reference_logits(model, ids):
    """The logits of ``model``'s weights through :func:`_reference_attention` (a stock Llama of the same shape)."""
    stock = {k: v for k, v in model.config.to_dict().items() if k not in ("laplacian_heads", "attn_implementation")}
    ref = tf.LlamaForCausalLM(tf.LlamaConfig(**stock)).double().eval()
    ref.load_state_dict(model.state_dict())
    ref.set_attn_implementation("test_sharing_reference")
    with torch.no_grad():
        return ref(ids).logits


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids).logits


def _llama(vocab: int, **kw):
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **kw,
    )
    return tf.LlamaForCausalLM(config).double().eval()


def _vision(**kw):
    return dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, **kw)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Saved checkpoints: a Llama decoder with a tokenizer, a ViT classifier, a CLIP model with Laplacian heads
    in its vision tower only, and the same Llama saved in the format of the release before."""
    from lapheads.lm.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("sharing")
    llama_dir = root / "llama"
    tok = train_tokenizer(["the list type is a mutable sequence; a tuple is not. " * 20], 300, llama_dir)
    llama = _llama(len(tok), bos_token_id=tok.bos_token_id, eos_token_id=None, pad_token_id=None)
    llama.generation_config.pad_token_id = tok.pad_token_id
    ids = torch.tensor([tok.encode("the list type is a tuple")])
    stock = _logits(llama, ids)
    lt.enable(llama, SPEC)
    want = _reference_logits(llama, ids)
    assert (want - stock).abs().max() > 1e-3  # the Laplacian model is another model
    assert (_logits(llama, ids) - want).abs().max() < 1e-10
    llama.save_pretrained(llama_dir)

    # the format of the release before: transformers' own config.json of the stock model, plus the two keys
    # that release added (its saved implementation name, and the heads)
    old_dir = root / "old"
    stock_model = _llama(len(tok), bos_token_id=tok.bos_token_id, eos_token_id=None, pad_token_id=None)
    stock_model.load_state_dict(llama.state_dict())
    stock_model.save_pretrained(old_dir)
    tok.save_pretrained(old_dir)
    old = json.loads((old_dir / "config.json").read_text())
    assert old["model_type"] == "llama" and "laplacian_heads" not in old
    old.update(laplacian_heads=SPEC, attn_implementation="laplacian_sdpa (import lapheads.transformers first)")
    (old_dir / "config.json").write_text(json.dumps(old, indent=2))

    torch.manual_seed(0)
    vit = tf.ViTForImageClassification._from_config(
        tf.ViTConfig(**_vision(image_size=32, patch_size=8, num_labels=3)), dtype=torch.float64
    ).eval()
    lt.enable(vit, 2)
    vit.save_pretrained(root / "vit")

    torch.manual_seed(0)
    clip = tf.CLIPModel._from_config(
        tf.CLIPConfig(
            text_config=_vision(vocab_size=99), vision_config=_vision(image_size=32, patch_size=8), projection_dim=16
        ),
        dtype=torch.float64,
    ).eval()
    lt.enable(clip, {"vision_config": 2, "text_config": 0})
    clip.save_pretrained(root / "clip")

    saved = json.loads((llama_dir / "config.json").read_text())
    assert saved["model_type"] == "lapheads-llama", saved.get("model_type")
    return types.SimpleNamespace(
        root=root,
        llama=llama_dir,
        old=old_dir,
        vit=root / "vit",
        clip=root / "clip",
        model=llama,
        tok=tok,
        ids=ids,
        want=want,
    )


def _fresh(script: str, tmp_path, env_extra=None) -> dict:
    """Run ``script`` in a fresh interpreter; it writes a JSON dict to the file named by ``sys.argv[1]``."""
    out = tmp_path / "out.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), **(env_extra or {}))
    r = subprocess.run(
        [sys.executable, "-c", script, str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        stdin=subprocess.DEVNULL,  # transformers asks before running custom code when it can
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


_PLAIN = """
import json, sys
import transformers as tf
D, VIT, CLIP, RESAVED = {llama!r}, {vit!r}, {clip!r}, {resaved!r}
paths = {{
    "AutoConfig": lambda: tf.AutoConfig.from_pretrained(D),
    "AutoModelForCausalLM": lambda: tf.AutoModelForCausalLM.from_pretrained(D),
    "AutoModelForCausalLM eager": lambda: tf.AutoModelForCausalLM.from_pretrained(D, attn_implementation="eager"),
    "AutoModelForCausalLM sdpa": lambda: tf.AutoModelForCausalLM.from_pretrained(D, attn_implementation="sdpa"),
    "AutoModel": lambda: tf.AutoModel.from_pretrained(D),
    "pipeline": lambda: tf.pipeline("text-generation", model=D),
    "pipeline eager": lambda: tf.pipeline("text-generation", model=D, model_kwargs={{"attn_implementation": "eager"}}),
    "AutoModel ViT": lambda: tf.AutoModel.from_pretrained(VIT, attn_implementation="eager"),
    "AutoModel CLIP": lambda: tf.AutoModel.from_pretrained(CLIP, attn_implementation="sdpa"),
}}
concrete = {{
    "LlamaForCausalLM": lambda: tf.LlamaForCausalLM.from_pretrained(D),
    "LlamaForCausalLM eager": lambda: tf.LlamaForCausalLM.from_pretrained(D, attn_implementation="eager"),
    "LlamaForCausalLM sdpa": lambda: tf.LlamaForCausalLM.from_pretrained(D, attn_implementation="sdpa"),
    "LlamaModel eager": lambda: tf.LlamaModel.from_pretrained(D, attn_implementation="eager"),
    "LlamaForCausalLM config=LlamaConfig": lambda: tf.LlamaForCausalLM.from_pretrained(
        D, config=tf.LlamaConfig.from_pretrained(D), attn_implementation="eager"),
    "LlamaForCausalLM saved again": lambda: tf.LlamaForCausalLM.from_pretrained(RESAVED, attn_implementation="eager"),
    "ViTForImageClassification eager": lambda: tf.ViTForImageClassification.from_pretrained(VIT, attn_implementation="eager"),
    "ViTModel": lambda: tf.ViTModel.from_pretrained(VIT),
    "CLIPModel sdpa": lambda: tf.CLIPModel.from_pretrained(CLIP, attn_implementation="sdpa"),
    "CLIPVisionModel eager": lambda: tf.CLIPVisionModel.from_pretrained(CLIP, attn_implementation="eager"),
    "CLIPTextModel": lambda: tf.CLIPTextModel.from_pretrained(CLIP),
}}
try:
    from lm_eval.models.huggingface import HFLM
    paths["HFLM"] = lambda: HFLM(pretrained=D, device="cpu", batch_size=1)
except ImportError:
    pass
out = {{}}
for group, loads in (("auto", paths), ("concrete", concrete)):
    for name, load in loads.items():
        try:
            load()
            out[name] = [group, None]
        except Exception as e:
            out[name] = [group, type(e).__name__ + ": " + str(e)]
out["lapheads imported"] = "lapheads" in sys.modules
json.dump(out, open(sys.argv[1], "w"))
"""


def test_plain_transformers_refuses_every_path(ckpts, tmp_path):
    """No lapheads in the interpreter: each loader raises, and the error names the way out (trust_remote_code
    for the auto classes, which runs lapheads' loader file; lapheads for the concrete classes)."""
    resaved = tmp_path / "resaved"
    lt.from_pretrained(str(ckpts.old), dtype=torch.float64).save_pretrained(resaved)  # the old format saved again
    got = _fresh(
        _PLAIN.format(llama=str(ckpts.llama), vit=str(ckpts.vit), clip=str(ckpts.clip), resaved=str(resaved)), tmp_path
    )
    assert got.pop("lapheads imported") is False
    assert len(got) >= 20
    for name, (group, error) in got.items():
        assert error is not None, f"{name}: plain transformers loaded a checkpoint with Laplacian heads"
        assert error.startswith("ValueError"), (name, error)
        assert (CUSTOM_CODE if group == "auto" else FIX) in error, (name, error)


_MISSING = """
import json
import transformers as tf
D = {llama!r}
out = {{}}
for name, load in {{
    "AutoConfig": lambda: tf.AutoConfig.from_pretrained(D, trust_remote_code=True),
    "AutoModelForCausalLM": lambda: tf.AutoModelForCausalLM.from_pretrained(D, trust_remote_code=True),
    "pipeline": lambda: tf.pipeline("text-generation", model=D, trust_remote_code=True),
}}.items():
    try:
        load()
        out[name] = None
    except Exception as e:
        out[name] = type(e).__name__ + ": " + str(e)
out["lapheads imported"] = "lapheads" in sys.modules
json.dump(out, open(sys.argv[1], "w"))
"""


def test_trust_remote_code_without_lapheads_installed_names_the_fix(ckpts, tmp_path):
    got = _fresh(NO_LAPHEADS + _MISSING.format(llama=str(ckpts.llama)), tmp_path)
    assert got.pop("lapheads imported") is False
    for name, error in got.items():
        assert error is not None and error.startswith("ImportError"), (name, error)
        assert FIX in error and "pip install --upgrade lapheads" in error and "\n" not in error, (name, error)


_REMOTE = """
import sys, torch
import transformers as tf
assert "lapheads" not in sys.modules
model = tf.AutoModelForCausalLM.from_pretrained({llama!r}, trust_remote_code=True, dtype=torch.float64).eval()
with torch.no_grad():
    logits = model(torch.tensor({ids!r})).logits
torch.save(logits, sys.argv[1] + ".pt")
import json
json.dump({{"attn": model.config._attn_implementation, "type": type(model).__name__}}, open(sys.argv[1], "w"))
"""


def test_trust_remote_code_with_lapheads_installed_gives_the_laplacian_model(ckpts, tmp_path):
    """transformers alone, told to trust the checkpoint's code: the loader file imports lapheads."""
    got = _fresh(_REMOTE.format(llama=str(ckpts.llama), ids=ckpts.ids.tolist()), tmp_path)
    assert got["type"] == "LlamaForCausalLM" and lt.is_laplacian_implementation(got["attn"])
    logits = torch.load(str(tmp_path / "out.json") + ".pt")
    assert (logits - ckpts.want).abs().max() < 1e-10


def test_with_lapheads_every_loader_gives_the_laplacian_model(ckpts):
    d, ids, want = str(ckpts.llama), ckpts.ids, ckpts.want
    loaded = {
        "lt.from_pretrained": lt.from_pretrained(d, dtype=torch.float64),
        "lt.from_pretrained LlamaForCausalLM": lt.from_pretrained(
            d, model_class=tf.LlamaForCausalLM, dtype=torch.float64
        ),
        "AutoModelForCausalLM": tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64),
        "pipeline": tf.pipeline("text-generation", model=d, dtype=torch.float64).model,
    }
    for name, model in loaded.items():
        assert type(model) is tf.LlamaForCausalLM, name
        assert (_logits(model, ids) - want).abs().max() < 1e-10, name
        assert "transformers_weights" not in vars(model.config) and "auto_map" not in vars(model.config), name
    # AutoConfig: the base config, its heads readable per layer (what a serving plugin reads)
    config = tf.AutoConfig.from_pretrained(d)
    assert type(config).__name__ == "LlamaConfig" and isinstance(config, tf.LlamaConfig)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert [set(s.indices) for s in lt.layer_selections(config)] == [REF_HEADS[0], REF_HEADS[1]]
    # a concrete class reads config.json itself, and is refused with lapheads imported too
    with pytest.raises(ValueError, match=FIX):
        tf.LlamaForCausalLM.from_pretrained(d)
    # an explicit standard implementation through the auto classes is refused; laplacian_heads=0 asks for it
    for impl in ("eager", "sdpa"):
        with pytest.raises(ConfigError, match="standard attention"):
            tf.AutoModelForCausalLM.from_pretrained(d, attn_implementation=impl)
    std = tf.AutoModelForCausalLM.from_pretrained(
        d, laplacian_heads=0, attn_implementation="eager", dtype=torch.float64
    )
    assert (_logits(std, ids) - want).abs().max() > 1e-3


def test_encoders_and_towers_load_with_lapheads(ckpts):
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    vit = lt.from_pretrained(str(ckpts.vit), model_class=tf.ViTForImageClassification, dtype=torch.float64).eval()
    eager = lt.from_pretrained(
        str(ckpts.vit), model_class=tf.ViTForImageClassification, eager=True, dtype=torch.float64
    ).eval()  # lapheads.ops' explicit reference
    with torch.no_grad():
        assert (vit(pixel_values=pixels).logits - eager(pixel_values=pixels).logits).abs().max() < 1e-12
    tower = lt.from_pretrained(str(ckpts.clip), model_class=tf.CLIPVisionModel, dtype=torch.float64)
    assert tower.config.laplacian_heads == 2 and type(tower.config).__name__ == "CLIPVisionConfig"
    text = lt.from_pretrained(str(ckpts.clip), model_class=tf.CLIPTextModel, dtype=torch.float64)
    assert text.config.laplacian_heads == 0
    config = tf.AutoConfig.from_pretrained(str(ckpts.clip))
    assert config.model_type == "clip" and config.vision_config.laplacian_heads == 2
    # on disk every sub-config carries the refusal too: a concrete tower class reads its sub-config alone
    saved = json.loads((ckpts.clip / "config.json").read_text())
    assert saved["model_type"] == "lapheads-clip" and saved["vision_config"]["model_type"] == "clip_vision_model"
    assert all(saved[k]["transformers_weights"].startswith(FIX) for k in ("vision_config", "text_config"))


def test_checkpoint_of_the_release_before_still_loads(ckpts, tmp_path):
    """Base model_type and the saved implementation name, as the release before wrote them (built in the
    fixture from transformers' own config.json): it loads Laplacian, and saved again it is in the new format."""
    d, ids, want = str(ckpts.old), ckpts.ids, ckpts.want
    for model in (
        lt.from_pretrained(d, dtype=torch.float64),
        tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64),
        tf.LlamaForCausalLM.from_pretrained(d, dtype=torch.float64),
    ):
        assert (_logits(model, ids) - want).abs().max() < 1e-10
        model.save_pretrained(tmp_path / "again")
        saved = json.loads((tmp_path / "again" / "config.json").read_text())
        assert saved["model_type"] == "lapheads-llama" and saved["architectures"] == ["LapheadsLlamaForCausalLM"]
        assert saved["laplacian_heads"] == SPEC
        assert (tmp_path / "again" / "lapheads_loader.py").is_file() and (tmp_path / "again" / "README.md").is_file()
        back = lt.from_pretrained(str(tmp_path / "again"), dtype=torch.float64)
        assert (_logits(back, ids) - want).abs().max() < 1e-10


def test_a_learnable_vit_of_the_release_before_still_loads(tmp_path):
    torch.manual_seed(0)
    vit = tf.ViTForImageClassification._from_config(
        tf.ViTConfig(**_vision(image_size=32, patch_size=8, num_labels=3)), dtype=torch.float64
    ).eval()
    lt.enable(vit, "learn:2")
    with torch.no_grad():
        for m in lt.mixing_modules(vit):
            m.lap_mix_a.add_(0.3)
            m.lap_mix_b.sub_(0.2)
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        want = vit(pixel_values=pixels).logits
    vit.save_pretrained(tmp_path)
    # rewrite config.json as the release before wrote it: the base model type and class, no loader, no weights name
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(model_type="vit", architectures=["ViTForImageClassification"])
    for key in ("auto_map", "transformers_weights"):
        del cfg[key]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for name in ("lapheads_loader.py", "README.md"):
        (tmp_path / name).unlink()
    back = lt.from_pretrained(str(tmp_path), model_class=tf.ViTForImageClassification, dtype=torch.float64).eval()
    with torch.no_grad():
        assert (back(pixel_values=pixels).logits - want).abs().max() < 1e-12


def test_peft_adapter_over_the_laplacian_base(ckpts, tmp_path):
    peft = pytest.importorskip("peft")
    d, ids = str(ckpts.llama), ckpts.ids
    base = lt.from_pretrained(d, dtype=torch.float64)
    base_logits = _logits(base, ids)
    torch.manual_seed(1)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, task_type="CAUSAL_LM")
    )
    want = _logits(model, ids)
    assert (want - base_logits).abs().max() > 1e-4  # the adapter changes the model
    model.save_pretrained(tmp_path / "adapter")
    back = peft.PeftModel.from_pretrained(lt.from_pretrained(d, dtype=torch.float64), tmp_path / "adapter")
    assert (_logits(back, ids) - want).abs().max() < 1e-10
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", dtype=torch.float64)
    assert (_logits(auto, ids) - want).abs().max() < 1e-10
    # merged into the weights: the reference attention over the merged weights, and saved it stays Laplacian
    merged = back.merge_and_unload()
    assert (_reference_logits(merged, ids) - want).abs().max() < 1e-10
    merged.save_pretrained(tmp_path / "merged")
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "lapheads-llama"
    assert (_logits(lt.from_pretrained(str(tmp_path / "merged"), dtype=torch.float64), ids) - want).abs().max() < 1e-10


def test_lm_eval_hflm_over_the_checkpoint(ckpts):
    pytest.importorskip("accelerate")
    lm_eval_hf = pytest.importorskip("lm_eval.models.huggingface")
    lm = lm_eval_hf.HFLM(pretrained=str(ckpts.llama), device="cpu", batch_size=1, dtype="float64")
    with torch.no_grad():
        assert (lm._model_call(ckpts.ids) - ckpts.want).abs().max() < 1e-10


# --------------------------------------------------------------------------- the model card
def _card(directory):
    from huggingface_hub import ModelCard

    return ModelCard.load(directory / "README.md")


def test_model_card(ckpts, tmp_path):
    card = _card(ckpts.llama)
    assert card.data.library_name == "transformers" and "laplacian-heads" in card.data.tags
    text = card.text
    # the heads per layer, as the spec [1, 4] of 4 heads reads by hand
    assert "| 0 | 3 | 1 |" in text and "| 1 | 0, 1, 2, 3 | 4 |" in text
    assert "pip install lapheads" in text and f'lt.from_pretrained("{ckpts.llama}")' in text
    cff = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "CITATION.cff"), encoding="utf-8"))
    paper = cff["preferred-citation"]
    assert paper["title"] in text and all(a["family-names"] in text for a in paper["authors"])
    assert paper["identifiers"][0]["value"] in text and str(paper["year"]) in text
    # an encoder's card names the class to load it with
    assert "model_class=transformers.ViTForImageClassification" in _card(ckpts.vit).text
    assert "`vision_config`: `laplacian_heads = 2`" in _card(ckpts.clip).text
    # the Hub id the model was loaded from is its base model
    model = lt.from_pretrained(str(ckpts.llama), dtype=torch.float64)
    model.config._name_or_path = "someone/llama-tiny"
    model.save_pretrained(tmp_path / "from_hub")
    assert _card(tmp_path / "from_hub").data.base_model == "someone/llama-tiny"
    assert _card(ckpts.llama).data.base_model is None  # a local path is no base model


def test_model_card_keeps_a_card_the_user_wrote(ckpts, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(ckpts.llama, d)
    model = lt.from_pretrained(str(d), dtype=torch.float64)
    (d / "README.md").write_text("# my model\n\nnotes\n")
    model.save_pretrained(d)
    assert (d / "README.md").read_text() == "# my model\n\nnotes\n"
    # a card lapheads wrote is written again with the new heads
    lt.enable(model, 2)
    model.save_pretrained(tmp_path / "two")
    lt.enable(model, [2, 3])
    model.save_pretrained(tmp_path / "two")
    text = _card(tmp_path / "two").text
    assert "| 0 | 2, 3 | 2 |" in text and "| 1 | 1, 2, 3 | 3 |" in text
    # saved without Laplacian heads: a standard checkpoint, lapheads' files gone
    lt.enable(model, 0)
    model.save_pretrained(tmp_path / "two")
    saved = json.loads((tmp_path / "two" / "config.json").read_text())
    assert saved["model_type"] == "llama" and "auto_map" not in saved and "transformers_weights" not in saved
    assert not (tmp_path / "two" / "README.md").exists() and not (tmp_path / "two" / "lapheads_loader.py").exists()


def test_push_to_hub_uploads_the_card_and_the_format(ckpts, monkeypatch):
    """model.push_to_hub with the Hub's HTTP calls replaced by a recorder: transformers writes its own README
    after saving; what is committed is lapheads' card, the Laplacian config.json and the loader file."""
    from huggingface_hub import HfApi, ModelCard
    from huggingface_hub.errors import EntryNotFoundError

    commits = []

    def create_repo(self, repo_id, **kwargs):
        return types.SimpleNamespace(repo_id=repo_id)

    def create_commit(self, repo_id, operations, **kwargs):
        files = {op.path_in_repo: open(op.path_or_fileobj, "rb").read() for op in operations}
        commits.append((repo_id, files))
        return types.SimpleNamespace(oid="0" * 40, commit_url="", pr_url=None)

    def no_card(cls, repo_id, **kwargs):
        raise EntryNotFoundError(f"{repo_id} has no README.md")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    monkeypatch.setattr(ModelCard, "load", classmethod(no_card))
    model = lt.from_pretrained(str(ckpts.llama), dtype=torch.float64)
    model.push_to_hub("someone/llama-lap")
    model.config.push_to_hub("someone/llama-lap-config")
    assert [r for r, _ in commits] == ["someone/llama-lap", "someone/llama-lap-config"]
    for _, files in commits:
        readme = files["README.md"].decode()
        assert "| 1 | 0, 1, 2, 3 | 4 |" in readme and 'lt.from_pretrained("someone/llama-lap' in readme
        assert "laplacian-heads" in readme
        config = json.loads(files["config.json"])
        assert config["model_type"] == "lapheads-llama" and config["transformers_weights"].startswith(FIX)
        assert b"from lapheads.transformers import" in files["lapheads_loader.py"]
    assert "model.safetensors" in commits[0][1]
