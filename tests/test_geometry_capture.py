"""Geometry capture from timm / transformers / plain torch models, plots and the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lapheads.cli import main as cli_main
from lapheads.errors import ConfigError
from lapheads.geometry import anova, neural_collapse, spectral_k99, within_sequence_cosine
from lapheads.geometry.capture import analyze_model, save_geometry_json
from lapheads.geometry.plots import plot_all

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")


def _tiny_vit(num_classes=10):
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=num_classes
    )


def _images(n_batches=2, b=6):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(b, 3, 32, 32, generator=g), torch.arange(b) % 3) for _ in range(n_batches)]


def test_vit_capture_matches_in_memory_measures():
    model = _tiny_vit().eval()
    batches = _images()
    res = analyze_model(model, batches, "vit", layers=[1, "pre_logits"])
    assert res["meta"]["layers"] == ["blocks.1", "pre_logits"]
    # reference: the same block output gathered in memory
    xs, sids, cids, cls = [], [], [], []
    for i, (x, y) in enumerate(batches):
        with torch.no_grad():
            patch, prefix = model.forward_intermediates(
                x, indices=[1], intermediates_only=True, output_fmt="NLC", return_prefix_tokens=True
            )[0]
        B, T, D = patch.shape
        xs.append(patch.reshape(B * T, D))
        sids.append((torch.arange(B) + 100 * i).repeat_interleave(T))
        cids.append(y.repeat_interleave(T))
        cls.append(prefix[:, 0])
    x, s, c = torch.cat(xs), torch.cat(sids), torch.cat(cids)
    layer = res["layers"]["blocks.1"]
    assert layer["anova"]["n_tokens"] == 2 * 6 * 16
    for k, v in anova(x, s, c).items():
        assert layer["anova"][k] == pytest.approx(v, rel=1e-6), k
    assert layer["nc_tokens"]["nc1"] == pytest.approx(neural_collapse(x, c)["nc1"], rel=1e-6)
    assert layer["spectra"]["k_mean"] == pytest.approx(spectral_k99(x, s)["k_mean"])
    assert layer["cosine"]["cosine_mean"] == pytest.approx(within_sequence_cosine(x, s)["cosine_mean"], rel=1e-6)
    assert layer["nc_cls"]["n_classes"] == 3
    pl = res["layers"]["pre_logits"]["nc_tokens"]
    assert 0.0 <= pl["nc4_agreement"] <= 1.0 and "nc3_self_duality" in pl  # the model's own head


def test_vit_include_prefix_and_bad_layer():
    model = _tiny_vit()
    res = analyze_model(model, _images(1), "vit", layers=[0], include_prefix=True)
    assert res["layers"]["blocks.0"]["anova"]["n_tokens"] == 6 * 17
    with pytest.raises(ConfigError, match="2 blocks"):
        analyze_model(model, _images(1), "vit", layers=[5])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_capture_next_token_classes_and_padding(arch):
    if arch == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=23, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0
        )
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=23,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 23, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding
    res = analyze_model(model.eval(), [{"input_ids": ids, "attention_mask": mask}], "hf", layers=[0, 2])
    last = res["layers"]["hidden.2"]
    assert last["anova"]["n_tokens"] == 27 - 3
    assert "between_class" not in last["anova"]  # LM: within vs between sequences
    # reference: hidden states of real tokens, class = next real token
    with torch.no_grad():
        hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[2]
    xs, ys = [], []
    for b in range(3):
        n = int(mask[b].sum())
        xs.append(hs[b, : n - 1])
        ys.append(ids[b, 1:n])
    ref = neural_collapse(torch.cat(xs), torch.cat(ys), classifier=model.get_output_embeddings())
    for k in ("nc1", "cdnv", "nc2_etf_distance", "nc3_self_duality", "nc4_agreement", "n_classes"):
        assert last["nc_tokens"][k] == pytest.approx(ref[k], rel=1e-6), k
    assert res["meta"]["classifier_layer"] == "hidden.2"


def test_hooks_capture_and_unknown_layer():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 5))
    batches = [(torch.randn(3, 7, 4), torch.tensor([0, 1, 1])) for _ in range(2)]
    res = analyze_model(model, batches, "hooks", layers=["0", "2"])
    assert set(res["layers"]) == {"0", "2"}
    assert res["layers"]["2"]["anova"]["n_sequences"] == 6
    with pytest.raises(ConfigError, match=r"'3\.weight'.*Valid names include: 0, 1, 2"):
        analyze_model(model, batches, "hooks", layers=["3.weight"])
    # NC4 with an explicit classifier via the second pass (a list is re-iterable)
    clf = torch.nn.Linear(5, 2)
    res = analyze_model(model, batches, "hooks", layers=["2"], classifier=clf, classifier_layer="2")
    assert 0 <= res["layers"]["2"]["nc_tokens"]["nc4_agreement"] <= 1
    res = analyze_model(model, iter(batches), "hooks", layers=["2"], classifier=clf, classifier_layer="2")
    assert "nc4_agreement" not in res["layers"]["2"]["nc_tokens"] and "NC4 skipped" in res["meta"]["notes"][0]


@pytest.mark.slow
def test_plots_and_json(tmp_path):
    model = _tiny_vit()
    a = analyze_model(model, _images(1), "vit")
    b = analyze_model(model, _images(1), "vit", spectra=False)
    paths = plot_all({"k=0": a, "k=all": b}, tmp_path)
    assert len(paths) == 5 and all(p.stat().st_size > 1000 for p in paths)
    assert plot_all(a, tmp_path / "single")[0].name == "anova_fractions.png"  # one result, no labels
    p = save_geometry_json({"x": float("inf"), "r": a}, tmp_path / "g.json")
    d = json.loads(p.read_text())
    assert d["x"] is None and d["r"]["layers"]["blocks.0"]["anova"]["total"] > 0


def _save_tiny_lm(path):
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        [topics[k] for k in sorted(topics)[:4]],
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.save_pretrained(path)
    cfg = transformers.GPT2Config(
        vocab_size=300, n_embd=16, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)


@pytest.mark.slow
def test_cli_end_to_end_text_and_vision(tmp_path, capsys):
    ck = tmp_path / "lm"
    _save_tiny_lm(ck)
    out = tmp_path / "geo_text"
    rc = cli_main(
        [
            "analyze",
            "--checkpoint",
            str(ck),
            "--label",
            "a",
            "--checkpoint",
            str(ck),
            "--label",
            "b",
            "--data",
            "pydoc",
            "--seq-len",
            "32",
            "--batch-size",
            "4",
            "--max-batches",
            "2",
            "--min-count",
            "2",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    g = json.loads((out / "geometry.json").read_text())
    assert set(g["runs"]) == {"a", "b"} and len(g["figures"]) == 5
    assert g["runs"]["a"]["layers"]["hidden.2"]["anova"]["n_tokens"] == 2 * 4 * 32
    assert all((out / f).is_file() for f in g["figures"])
    assert g["runs"]["a"]["layers"]["hidden.1"]["anova"]["total"] == pytest.approx(  # same model twice
        g["runs"]["b"]["layers"]["hidden.1"]["anova"]["total"]
    )
    # a timm model with weights saved to a file
    from safetensors.torch import save_file

    m = _tiny_vit()
    save_file(m.state_dict(), str(tmp_path / "vit.safetensors"))
    out2 = tmp_path / "geo_vit"
    args = [
        "analyze",
        "--checkpoint",
        "vit_tiny_patch16_224",
        "--weights",
        str(tmp_path / "vit.safetensors"),
        "--model-args",
        "img_size=32",
        "patch_size=8",
        "depth=2",
        "num_classes=10",
        "--data",
        "digits",
        "--batch-size",
        "16",
        "--max-batches",
        "2",
        "--layers",
        "1,pre_logits",
        "--no-figures",
        "--out",
        str(out2),
    ]
    assert cli_main(args) == 0
    g2 = json.loads((out2 / "geometry.json").read_text())
    r = g2["runs"]["vit_tiny_patch16_224"]["layers"]
    assert r["blocks.1"]["anova"]["n_tokens"] == 32 * 16 and "nc4_agreement" in r["pre_logits"]["nc_tokens"]
    # user errors exit with status 2 and one line
    capsys.readouterr()
    assert cli_main(["analyze", "--checkpoint", str(ck), "--data", "pydoc", "--layers", "9", "--out", str(out)]) == 2
    assert "hidden states are 0..2" in capsys.readouterr().err
    assert cli_main(["analyze", "--checkpoint", "no_such_model_xyz", "--data", "digits", "--out", str(out)]) == 2
    assert cli_main(args[:5] + ["--model-args", "img_size=32", "--data", "digits", "--out", str(out2)]) == 2
    assert cli_main(["analyze", "--run", str(tmp_path), "--data", "digits", "--out", str(out)]) == 2  # not a run


def test_load_checkpoint_restores_laplacian_heads_in_a_fresh_process(tmp_path):
    """``lapheads analyze --checkpoint`` loads a Laplacian checkpoint with its heads, not as sdpa."""
    import os
    import subprocess
    import sys

    import lapheads.transformers as lt

    torch.manual_seed(0)
    cfg = transformers.NanoChatConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    model = transformers.NanoChatForCausalLM(cfg).eval()
    lt.enable(model, 2)
    model.save_pretrained(tmp_path)
    ids = torch.arange(3, 11)[None]
    with torch.no_grad():
        torch.save(model(ids).logits, tmp_path / "want.pt")
    script = f"""
import sys, torch
assert "lapheads.transformers" not in sys.modules
from lapheads.engine.pretrained import load_checkpoint
model, kind, _ = load_checkpoint({str(tmp_path)!r})
with torch.no_grad():
    got = model(torch.arange(3, 11)[None]).logits
print(kind, model.config._attn_implementation, torch.equal(got, torch.load({str(tmp_path / "want.pt")!r})))
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-3:] == ["hf", lt.ATTN_IMPLEMENTATION, "True"], r.stdout


def test_cdnv_leaves_out_class_pairs_with_coincident_means():
    from lapheads.geometry import cdnv

    # classes 0 and 1: the same point (means equal, variance 0: CDNV 0/0); class 2: (0,1), (0,3)
    x = torch.tensor([[1.0, 0.0]] * 4 + [[0.0, 1.0], [0.0, 3.0]], dtype=torch.float64)
    r = cdnv(x, torch.tensor([0, 0, 1, 1, 2, 2]))
    assert r["n_pairs"] == 3 and r["n_pairs_coincident"] == 1
    assert r["cdnv"] == pytest.approx((0.0 + 1.0) / (2 * 5.0))  # pairs (0, 2) and (1, 2) alike


def test_embedding_layer_cdnv_at_min_count_10_is_computed_and_explained():
    """At the embedding layer a token's vector is a function of its id: next-token classes that always
    follow the same token have identical means. CDNV is then computed over the other pairs, with a note."""
    torch.manual_seed(0)
    cfg = transformers.NanoChatConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = transformers.NanoChatForCausalLM(cfg).eval()
    ids = torch.tensor([5, 6, 5, 7] * 16).repeat(2, 1)  # classes 6 and 7 always follow token 5
    res = analyze_model(
        model,
        [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}],
        kind="hf",
        layers=[0, 1],
        num_classes=16,
        min_count=10,
        nc4=False,
    )
    nc = res["layers"]["hidden.0"]["nc_tokens"]
    assert nc["n_classes"] == 3 and nc["n_pairs_coincident"] == 1
    assert math.isfinite(nc["cdnv"]) and nc["cdnv"] > 0
    assert any("hidden.0 nc_tokens: 1 class pair(s) have identical class means" in n for n in res["meta"]["notes"])
    assert res["layers"]["hidden.1"]["nc_tokens"]["n_pairs_coincident"] == 0
