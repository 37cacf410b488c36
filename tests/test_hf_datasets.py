"""Hugging Face ``datasets`` as data (``hf:PATH_OR_NAME``): LM corpora, image sets, chat sets, offline.

Every dataset is written by the test (``save_to_disk``, parquet, JSON lines); nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_classify import DIGITS, TINY

from lapheads.cli import main as cli
from lapheads.data.images import build_image_dataset, load_digits_arrays
from lapheads.data.text import embedded_documents
from lapheads.engine.config import load_config
from lapheads.errors import DataError
from lapheads.recipes import lm as R

datasets = pytest.importorskip("datasets")


@pytest.fixture(autouse=True)
def _private_hf_cache(tmp_path, monkeypatch):
    # load_dataset(...) of local files caches Arrow files; keep them out of the user's ~/.cache
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def _lm_overrides(tmp_path: Path, corpus: str, *extra: str) -> list[str]:
    return [
        f"data.cache_dir={tmp_path / 'cache'}",
        f"data.corpus={corpus}",
        "data.text_field=content",
        "data.vocab_size=300",
        "data.seq_len=32",
        "data.batch_size=4",
        "data.eval_tokens=256",
        "model.depth=1",
        "model.width=32",
        "model.n_heads=2",
        "model.laplacian_heads=1",
        "samples.max_new_tokens=0",
        "train.max_steps=2",
        "train.eval_every=0",
        "train.progress=false",
        *extra,
    ]


def test_lm_trains_on_a_saved_dataset_and_a_streamed_parquet_corpus_gives_the_same_tokens(tmp_path, capsys):
    docs = list(embedded_documents())[:30]
    ds = datasets.Dataset.from_dict({"id": list(range(len(docs))), "content": docs})
    ds.save_to_disk(str(tmp_path / "disk"))
    ds.to_parquet(str(tmp_path / "corpus.parquet"))
    out = tmp_path / "run"
    rc = cli(
        [
            "train",
            "lm",
            "--out",
            str(out),
            *[a for o in _lm_overrides(tmp_path, f"hf:{tmp_path / 'disk'}") for a in ("--set", o)],
        ]
    )
    assert rc == 0, capsys.readouterr().err
    final = json.loads((out / "final" / "metrics.json").read_text())
    assert np.isfinite(final["val_bpb"])
    built = [p for p in (tmp_path / "cache").iterdir() if (p / "done.json").is_file()]
    assert len(built) == 1 and json.loads((built[0] / "done.json").read_text())["corpus"]["hf"] == str(
        tmp_path / "disk"
    )
    # the same documents from parquet, streamed, tokenized with that tokenizer: the same shards
    cfg = load_config(
        R.LMConfig,
        None,
        _lm_overrides(
            tmp_path,
            f"hf:{tmp_path / 'corpus.parquet'}",
            f"data.tokenizer={built[0] / 'tokenizer'}",
            "data.streaming=true",
        ),
    )
    _, shard_dir = R.prepare_data(cfg.data)
    a = json.loads((built[0] / "shards" / "index.json").read_text())
    b = json.loads((shard_dir / "index.json").read_text())
    for split in ("train", "val"):
        assert (a["splits"][split]["tokens"], a["splits"][split]["bytes"]) == (
            b["splits"][split]["tokens"],
            b["splits"][split]["bytes"],
        )


def _digits_dataset(n: int = 240):
    images, target = load_digits_arrays()
    pixels = np.clip(np.rint(images[:n] * (255 / 16)), 0, 255).astype(np.uint8)
    from PIL import Image

    features = datasets.Features(
        {"img": datasets.Image(), "digit": datasets.ClassLabel(names=[f"d{i}" for i in range(10)])}
    )
    return datasets.Dataset.from_dict(
        {"img": [Image.fromarray(p, mode="L") for p in pixels], "digit": target[:n].tolist()}, features=features
    )


def test_classify_trains_on_an_image_dataset_and_a_bad_column_is_one_line(tmp_path, capsys):
    _digits_dataset().save_to_disk(str(tmp_path / "digits"))
    spec = f"hf:{tmp_path / 'digits'}"
    train = build_image_dataset(spec, "train", image_column="img", label_column="digit")
    val = build_image_dataset(spec, "val", image_column="img", label_column="digit")
    assert train.classes == [f"d{i}" for i in range(10)] and train.channels == 1
    assert len(train) + len(val) == 240 and not set(train.indices) & set(val.indices)  # 80/20 of one split
    out = tmp_path / "run"
    base = [
        "train",
        "classify",
        "--config",
        DIGITS,
        *TINY,
        "--set",
        f"data.train={spec}",
        "--set",
        "data.image_column=img",
        "--set",
        "train.max_steps=3",
        "--set",
        "data.max_eval_items=32",
    ]
    assert cli([*base, "--out", str(out), "--set", "data.label_column=digit"]) == 0
    final = json.loads((out / "final" / "metrics.json").read_text())
    assert final["n"] == 32 and 0.0 <= final["top1"] <= 1.0
    capsys.readouterr()
    assert cli([*base, "--out", str(tmp_path / "bad"), "--set", "data.label_column=labels"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "'labels'" in err and "data.label_column" in err and "img, digit" in err
    assert not (tmp_path / "bad" / "config.yaml").exists()


def test_image_dataset_with_splits_and_string_labels(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    img = [Image.fromarray(rng.integers(0, 255, (6, 6, 3), dtype=np.uint8)) for _ in range(12)]
    names = ["cat", "dog", "eel"]
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"image": img[:9], "label": [names[i % 3] for i in range(9)]}),
            "test": datasets.Dataset.from_dict({"image": img[9:], "label": ["eel", "dog", "eel"]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "pets"))
    train = build_image_dataset(f"hf:{tmp_path / 'pets'}", "train")
    val = build_image_dataset(f"hf:{tmp_path / 'pets'}", "val")  # the test split
    assert train.classes == val.classes == names and len(train) == 9 and len(val) == 3
    assert val.targets.tolist() == [2, 1, 2] and train.channels == 3
    x, y = val[1]
    assert x.mode == "RGB" and x.size == (6, 6) and y == 1
    with pytest.raises(DataError, match="no split 'extra'; its splits: train, test"):
        build_image_dataset({"kind": "hf", "path": str(tmp_path / "pets"), "hf_split": "extra"}, "train")


def test_sft_chat_set_from_json_lines_and_a_bad_row(tmp_path):
    from lapheads.recipes.sft import read_chat_hf

    good = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(3)
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in good))
    convs = read_chat_hf(str(path))
    assert [n for n, _ in convs] == [1, 2, 3] and convs[2][1][1]["content"] == "a2"
    with pytest.raises(DataError, match="no column 'conversations'"):
        read_chat_hf(str(path), column="conversations")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:train:1: messages\[0\] has unknown role 'robot'"):
        read_chat_hf(str(bad))


def test_a_missing_dataset_is_one_line(tmp_path):
    with pytest.raises(DataError) as e:
        build_image_dataset(f"hf:{tmp_path / 'nowhere'}", "train")
    assert "nowhere" in str(e.value) and "\n" not in str(e.value)


def test_dino_trains_on_an_image_dataset_and_measures_knn_on_its_labels(tmp_path):
    from test_dino import _run, tiny_cfg

    from lapheads.recipes.dino import DinoDataConfig

    _digits_dataset(160).save_to_disk(str(tmp_path / "digits"))
    cfg = tiny_cfg(max_steps=2, ckpt_every=0)
    cfg.data = DinoDataConfig(
        train=f"hf:{tmp_path / 'digits'}", image_column="img", label_column="digit", batch_size=32
    )
    result = _run(tmp_path / "run", cfg)
    assert 0.0 <= result["knn_k20_top1"] <= 1.0
    assert (
        json.loads((tmp_path / "run" / "final" / "metrics.json").read_text())["knn_k20_top1"] == result["knn_k20_top1"]
    )


def test_a_directory_of_data_files_resolves_as_datasets_resolves_it(tmp_path):
    from lapheads.data.text import check_hf_column, open_hf_dataset, read_hf_dataset

    (tmp_path / "corpus").mkdir()
    for split, texts in (("train", ["alpha", "", "beta"]), ("test", ["gamma"])):
        (tmp_path / "corpus" / f"{split}.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    for streaming in (False, True):
        ds = open_hf_dataset(str(tmp_path / "corpus"), "train", streaming=streaming)
        check_hf_column(ds, "body", "corpus", "data.text_field")
        assert list(read_hf_dataset(ds, "body")) == ["alpha", "beta"]  # empty rows are no documents
    with pytest.raises(DataError, match=r"no column 'text' \(data.text_field\); its columns: body"):
        check_hf_column(ds, "text", "corpus", "data.text_field")
    with pytest.raises(DataError, match="split 'validation'"):
        open_hf_dataset(str(tmp_path / "corpus"), "validation")


def test_tokenizer_train_and_data_tokenize_read_an_hf_dataset_like_the_same_jsonl(tmp_path, capsys):
    """`lapheads tokenizer train` / `lapheads data tokenize --input hf:...` (a saved dataset and a
    streamed parquet file) give the tokenizer and shards that the same documents as JSONL give."""
    docs = [d for d in embedded_documents()][:40]
    rows = {"content": docs, "n": list(range(len(docs)))}
    saved, parquet, jsonl = tmp_path / "saved", tmp_path / "c.parquet", tmp_path / "c.jsonl"
    datasets.Dataset.from_dict(rows).save_to_disk(str(saved))
    datasets.Dataset.from_dict(rows).to_parquet(str(parquet))
    jsonl.write_text("".join(json.dumps({"content": d}) + "\n" for d in docs))
    tok_args = ["--vocab-size", "300", "--text-field", "content"]
    assert cli(["tokenizer", "train", "--input", str(jsonl), *tok_args, "--out", str(tmp_path / "tok_j")]) == 0
    assert cli(["tokenizer", "train", "--input", f"hf:{saved}", *tok_args, "--out", str(tmp_path / "tok_h")]) == 0
    assert (tmp_path / "tok_j" / "tokenizer.json").read_bytes() == (tmp_path / "tok_h" / "tokenizer.json").read_bytes()
    common = [
        "--tokenizer",
        str(tmp_path / "tok_j"),
        "--text-field",
        "content",
        "--shard-tokens",
        "2000",
        "--no-progress",
    ]
    runs = {
        "jsonl": ["--input", str(jsonl)],
        "saved": ["--input", f"hf:{saved}"],
        "stream": ["--input", f"hf:{parquet}", "--streaming"],
    }
    for name, src in runs.items():
        assert cli(["data", "tokenize", *src, *common, "--out", str(tmp_path / f"out_{name}")]) == 0, name
    capsys.readouterr()

    def shards(d: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != "index.json"}

    want = shards(tmp_path / "out_jsonl")
    assert len(want) >= 2
    stats = json.loads((tmp_path / "out_jsonl" / "index.json").read_text())["splits"]
    for name in ("saved", "stream"):
        assert shards(tmp_path / f"out_{name}") == want, name
        assert json.loads((tmp_path / f"out_{name}" / "index.json").read_text())["splits"] == stats, name
    # a wrong column is one line naming the option and the columns there are
    rc = cli(["data", "tokenize", "--input", f"hf:{saved}", *common[:2], "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--text-field" in err[0] and "content" in err[0], err
    assert not (tmp_path / "bad").exists()
