"""SFT recipe: loss mask on assistant tokens, packing, mixtures, bad chat JSONL, a run from a pretrained LM."""

from __future__ import annotations

import json

import pytest
import torch
from _lm_helpers import tiny_lm_run

from lapheads.engine import RunDir
from lapheads.engine.config import load_config
from lapheads.engine.launch import launch
from lapheads.errors import ConfigError, DataError
from lapheads.lm.tokenizer import render_chat
from lapheads.recipes import lm as R
from lapheads.recipes import sft as S


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A 4-step tiny LM run with 2 Laplacian heads per layer (weights are not the point here)."""
    return tiny_lm_run(tmp_path_factory.mktemp("sft"), "2", 4)


def _sft_cfg(run, *over):
    return load_config(
        S.SFTConfig,
        None,
        [
            f"init_from={run}",
            "data.seq_len=96",
            "data.batch_size=4",
            "train.max_steps=6",
            "train.progress=false",
            "train.log_every=1",
            "train.eval_every=3",
        ]
        + list(over),
    )


def test_topics_qa_and_loss_mask(pretrained):
    convs = S.topics_qa()
    assert len(convs) >= 70 and all(len(c["messages"]) == 2 for c in convs)
    _, tok = R.load_model(pretrained)
    msgs = [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ok"},
    ]
    ids, mask = render_chat(tok, msgs)
    b = S.collate_padded([(ids, mask), (ids[:7], mask[:7])], tok.pad_token_id)
    y = b["labels"][0]
    trained = [t for t in y.tolist() if t != -100]
    # exactly the assistant content and <|assistant_end|> of each assistant turn
    want = (
        tok.encode("hello", add_special_tokens=False)
        + [tok.convert_tokens_to_ids("<|assistant_end|>")]
        + tok.encode("ok", add_special_tokens=False)
        + [tok.convert_tokens_to_ids("<|assistant_end|>")]
    )
    assert trained == want
    assert torch.equal(b["input_ids"][0], torch.tensor(ids[:-1]))
    assert b["attention_mask"][1].tolist() == [1] * 6 + [0] * (len(ids) - 7)
    assert (b["labels"][1, 6:] == -100).all()


def test_packing_restarts_positions():
    a = ([0, 5, 6, 7], [0, 0, 1, 1])
    c = ([0, 8, 9], [0, 1, 1])
    rows = S.pack_rows([a, c, a], row_tokens=9)
    assert [len(r) for r in rows] == [2, 1]
    b = S.collate_packed(rows, 9, pad_id=99)
    assert b["input_ids"][0].tolist() == [0, 5, 6, 7, 0, 8, 99, 99]  # inputs are ids[:-1]
    assert b["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 0, 1]  # the filler is its own sequence
    # the target of a conversation's last token is the next one's BOS: not trained
    assert b["labels"][0].tolist() == [-100, 6, 7, -100, 8, 9, -100, -100]


def test_bad_chat_jsonl_names_file_and_line(pretrained, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
        + "\n"
        + json.dumps({"messages": [{"role": "robot", "content": "beep"}]})
        + "\n"
    )
    with pytest.raises(DataError, match=r"bad.jsonl:2:.*unknown role 'robot'"):
        S.SFTTask(_sft_cfg(pretrained, f"data.sources=[{{path: {bad}}}]"), _info())
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl.*empty"):
        S.SFTTask(_sft_cfg(pretrained, f"data.sources=[{{path: {empty}}}]"), _info())
    notjson = tmp_path / "nj.jsonl"
    notjson.write_text('{"messages": []}\n')
    with pytest.raises(DataError, match="nj.jsonl:1"):
        S.SFTTask(_sft_cfg(pretrained, f"data.sources=[{{path: {notjson}}}]"), _info())
    with pytest.raises(ConfigError, match="init_from"):
        load_config(S.SFTConfig, None, [])


def _info():
    from lapheads.engine.dist import DistInfo

    return DistInfo()


def test_mixture_weights(pretrained, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for p, word in ((a, "alpha"), (b, "beta")):
        p.write_text(
            "".join(
                json.dumps(
                    {"messages": [{"role": "user", "content": f"{word} {i}"}, {"role": "assistant", "content": word}]}
                )
                + "\n"
                for i in range(10)
            )
        )
    cfg = _sft_cfg(
        pretrained,
        f"data.sources=[{{path: {a}, weight: 3.0}}, {{path: {b}, weight: 1.0}}]",
        "data.val_fraction=0.0",
        f"data.val=[{a}]",
    )
    task = S.SFTTask(cfg, _info())
    assert task.source_probs.tolist() == pytest.approx([0.75, 0.25])
    alpha = task.tokenizer.encode("alpha", add_special_tokens=False)[0]
    it = task.batches(0)
    n_alpha = n = 0
    for _ in range(50):
        y = next(it)["labels"]
        first = y[(y != -100).cumsum(1) == 1]  # first trained token of every row
        n_alpha += int((first == alpha).sum())
        n += len(first)
    assert 0.65 < n_alpha / n < 0.85
    # batches are a pure function of the micro step (exact resume)
    assert torch.equal(next(task.batches(7))["input_ids"], next(task.batches(7))["input_ids"])


@pytest.mark.parametrize("packing", [False, True])
def test_sft_runs_from_pretrained(pretrained, tmp_path, packing):
    out = tmp_path / "sft"
    launch("sft", _sft_cfg(pretrained, f"data.packing={str(packing).lower()}"), S.SFTTask, str(out))
    recs = RunDir(out).metrics()
    val = [r["val_loss"] for r in recs if r.get("split") == "val"]
    assert len(val) == 2 and val[-1] < val[0]
    model, tok = R.load_model(out)
    assert model.config.laplacian_heads == 2
    spec = json.loads((out / "final" / "model.json").read_text())
    assert spec["recipe"] == "sft" and spec["init_from"] == str(pretrained)


@pytest.mark.parametrize("k", [0, 2])
def test_packed_rows_do_not_attend_across_conversations(k):
    from lapheads.lm.model import LMModelConfig, build_model

    torch.manual_seed(0)
    m = build_model(LMModelConfig(depth=2, width=64, n_heads=4, laplacian_heads=k), 50, 32).eval()
    with torch.no_grad():
        for p in m.parameters():
            if not p.any():
                p.normal_(0, 0.2)  # zero-init outputs would hide any leak
    a = ([0, 5, 6, 7, 8], [0, 0, 1, 1, 1])
    c = ([0, 9, 10, 11], [0, 1, 1, 1])
    b = S.collate_packed([[a, c]], 10, pad_id=1)
    with torch.no_grad():
        packed = m(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits[0]
        alone = m(input_ids=torch.tensor([c[0][:-1]]), use_cache=False).logits[0]
    assert torch.allclose(packed[5:8], alone, atol=1e-5)
