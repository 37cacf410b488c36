"""lapheads.data.text and lapheads.data.shards: corpus readers, token shards (split, resume, statistics), the sampler and the CLI."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import lapheads.data.shards as shards_data
from lapheads import ConfigError, DataError
from lapheads.cli import main as cli_main
from lapheads.data.shards import TokenShards, read_index, tokenize_to_shards
from lapheads.data.text import (
    check_inputs,
    embedded_documents,
    is_validation_document,
    iter_documents,
    read_jsonl,
    read_parquet,
)
from lapheads.lm.tokenizer import tokenizer_hash, train_tokenizer

DOCS = list(embedded_documents())


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_tokenizer(DOCS[:15], 320, d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    from lapheads.lm.tokenizer import load_tokenizer

    return load_tokenizer(tok_dir)


CORPUS = DOCS[:24]  # ~120k characters: enough for several small shards


def _split_docs(stream: np.ndarray, bos: int) -> list[np.ndarray]:
    starts = np.flatnonzero(stream == bos)
    return [stream[a + 1 : b] for a, b in zip(starts, list(starts[1:]) + [len(stream)])]


# --------------------------------------------------------------------------- readers
def test_embedded_corpus():
    from pydoc_data.topics import topics

    assert len(DOCS) == len(topics) > 50
    assert DOCS == [topics[k] for k in sorted(topics)]


def test_readers(tmp_path):
    (tmp_path / "a.txt").write_text("first document\nwith two lines", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"text": "j1"}\n\n{"text": "j2", "id": 3}\n')
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write('{"body": "g1"}\n')
    table = pa.table({"id": list(range(5)), "text": ["p0", "p1", None, "p3", "p4"]})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)  # three row groups
    assert pq.ParquetFile(tmp_path / "d.parquet").num_row_groups == 3
    assert list(read_parquet(tmp_path / "d.parquet")) == ["p0", "p1", "p3", "p4"]
    assert list(read_jsonl(tmp_path / "c.jsonl.gz", text_field="body")) == ["g1"]
    paths = [tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "d.parquet"]
    check_inputs(paths)
    assert list(iter_documents(paths)) == ["first document\nwith two lines", "j1", "j2", "p0", "p1", "p3", "p4"]


def test_reader_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "ok2"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: not valid JSON"):
        list(read_jsonl(bad))
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"content": "x"}\n')
    with pytest.raises(DataError, match=r"nofield\.jsonl:1: no key 'text'; keys found: \['content'\]"):
        check_inputs([nofield])
    pq.write_table(pa.table({"content": ["a"], "url": ["u"]}), tmp_path / "cols.parquet")
    with pytest.raises(
        DataError,
        match=r"cols\.parquet: parquet file has no column 'text'; columns found: "
        r"\['content', 'url'\]",
    ):
        check_inputs([tmp_path / "cols.parquet"])
    (tmp_path / "trunc.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"trunc\.parquet: not a readable parquet file"):
        check_inputs([tmp_path / "trunc.parquet"])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"empty\.txt: the file is empty"):
        check_inputs([tmp_path / "empty.txt"])
    with pytest.raises(DataError, match=r"nope\.txt: no such file"):
        check_inputs([tmp_path / "nope.txt"])
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin\.txt: not UTF-8"):
        list(iter_documents([tmp_path / "latin.txt"]))


# --------------------------------------------------------------------------- splitting
def test_validation_split_is_by_document_and_exact():
    val = [i for i in range(100) if is_validation_document(i, 0.05)]
    assert val == [0, 20, 40, 60, 80]
    assert sum(is_validation_document(i, 0.1) for i in range(1000)) == 100
    assert not any(is_validation_document(i, 0.0) for i in range(50))
    with pytest.raises(ConfigError):
        is_validation_document(0, 1.0)


# --------------------------------------------------------------------------- shards
def test_shards_content_split_and_statistics(tok, tmp_path):
    index = tokenize_to_shards(CORPUS, tok, tmp_path, shard_tokens=8000, val_fraction=0.1, progress=False)
    assert index["complete"] and index["dtype"] == "uint16" and index["tokenizer_hash"] == tokenizer_hash(tok)
    assert index["documents_consumed"] == len(CORPUS)
    assert len(index["splits"]["train"]["shards"]) > 2  # several shards, whole documents each
    assert read_index(tmp_path) == json.loads((tmp_path / "index.json").read_text())
    for split in ("train", "val"):
        want = [d for i, d in enumerate(CORPUS) if is_validation_document(i, 0.1) == (split == "val")]
        sh = TokenShards(tmp_path, split, tokenizer=tok)
        stream = sh.tokens(0, len(sh))
        assert stream[0] == tok.bos_token_id
        docs = _split_docs(stream, tok.bos_token_id)
        assert [tok.decode(d.tolist()) for d in docs] == want
        for s in index["splits"][split]["shards"]:  # every shard starts at a document boundary
            assert np.fromfile(tmp_path / s["file"], dtype=np.uint16)[0] == tok.bos_token_id
        n_bytes = sum(len(d.encode()) for d in want)
        assert sh.num_tokens == sum(len(tok.encode(d, add_special_tokens=False)) + 1 for d in want)
        assert sh.bytes_per_token == pytest.approx(n_bytes / sh.num_tokens)
        assert sh.num_documents == len(want)
    assert index["splits"]["val"]["documents"] == 3  # documents 0, 10, 20


def test_special_token_strings_in_text_are_text(tok, tmp_path):
    tokenize_to_shards(["say <|bos|> twice <|bos|>", "plain"], tok, tmp_path, val_fraction=0.0, progress=False)
    stream = TokenShards(tmp_path, "train").tokens(0, len(TokenShards(tmp_path, "train")))
    assert int((stream == tok.bos_token_id).sum()) == 2  # one per document, none from the text
    assert tok.backend_tokenizer.encode("<|bos|>", add_special_tokens=False).ids == [tok.bos_token_id]  # restored


def test_uint32_and_vocab_that_does_not_fit(tok, tmp_path):
    idx = tokenize_to_shards(CORPUS[:3], tok, tmp_path / "u32", dtype="uint32", val_fraction=0.0, progress=False)
    assert idx["dtype"] == "uint32"
    assert TokenShards(tmp_path / "u32").tokens(0, 5).tolist() == TokenShards(tmp_path / "u32").maps[0][:5].tolist()

    class Huge:  # a tokenizer that claims 70,000 tokens
        def __init__(self, t):
            self._t = t

        def __len__(self):
            return 70_000

        def __getattr__(self, name):
            return getattr(self._t, name)

    with pytest.raises(DataError, match="70000 tokens, which do not fit uint16"):
        tokenize_to_shards(CORPUS[:3], Huge(tok), tmp_path / "x", dtype="uint16", progress=False)
    assert (
        tokenize_to_shards(CORPUS[:3], Huge(tok), tmp_path / "auto", val_fraction=0.0, progress=False)["dtype"]
        == "uint32"
    )


def test_bad_corpus(tok, tmp_path):
    with pytest.raises(DataError, match="empty"):
        tokenize_to_shards([], tok, tmp_path / "a", progress=False)
    with pytest.raises(DataError, match="empty"):
        tokenize_to_shards(["", ""], tok, tmp_path / "b", progress=False)
    with pytest.raises(DataError, match="leaves no training document") as e:
        tokenize_to_shards(["only one"], tok, tmp_path / "c", val_fraction=0.5, progress=False)
    assert "--val-by tokens" in str(e.value) and "--split-documents" in str(e.value)
    with pytest.raises(ConfigError, match="val_fraction"):
        tokenize_to_shards(["x"], tok, tmp_path / "d", val_fraction=1.5, progress=False)


class _Killed(Exception):
    pass


def _killed_after(docs, n):
    for i, d in enumerate(docs):
        if i == n:
            raise _Killed()
        yield d


def _shard_bytes(path):
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.bin"))}


def test_resume_after_kill_matches_clean_run(tok, tmp_path, monkeypatch):
    kw = dict(shard_tokens=6000, val_fraction=0.1, progress=False)
    clean = tokenize_to_shards(CORPUS, tok, tmp_path / "clean", **kw)

    # 1. killed while reading the input
    out = tmp_path / "killed"
    with pytest.raises(_Killed):
        tokenize_to_shards(_killed_after(CORPUS, 15), tok, out, batch_documents=4, **kw)
    partial = read_index(out)
    assert not partial["complete"] and 0 < partial["splits"]["train"]["next_document"] < 15
    # The safe restart point is where BOTH splits are committed (the small val split flushes rarely).
    assert partial["documents_consumed"] == min(s["next_document"] for s in partial["splits"].values())
    with pytest.raises(DataError, match="incomplete"):
        TokenShards(out, "train")
    with pytest.raises(DataError, match="already exists"):
        tokenize_to_shards(CORPUS, tok, out, **kw)
    with pytest.raises(DataError, match="has only 0; resume with the same input"):
        tokenize_to_shards([], tok, out, resume=True, **kw)
    (out / "train_000099.bin.tmp").write_bytes(b"half-written junk")  # a torn write is harmless
    resumed = tokenize_to_shards(CORPUS, tok, out, resume=True, **kw)
    assert resumed == clean | {"source": resumed["source"]}
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "clean")

    # 2. killed between a shard's os.replace and the index update: the orphan shard is rewritten
    out2 = tmp_path / "killed2"
    real = shards_data._write_index
    calls = {"n": 0}

    def dying(path, index):
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Killed()
        real(path, index)

    monkeypatch.setattr(shards_data, "_write_index", dying)
    with pytest.raises(_Killed):
        tokenize_to_shards(CORPUS, tok, out2, **kw)
    monkeypatch.setattr(shards_data, "_write_index", real)
    assert len(list(out2.glob("*.bin"))) > len(read_index(out2)["splits"]["train"]["shards"]) + len(
        read_index(out2)["splits"]["val"]["shards"]
    )
    tokenize_to_shards(CORPUS, tok, out2, resume=True, **kw)
    assert _shard_bytes(out2) == _shard_bytes(tmp_path / "clean")

    # 3. a finished directory resumes to a no-op; a different tokenizer or setting is refused
    assert tokenize_to_shards(CORPUS, tok, out, resume=True, **kw)["complete"]
    other = train_tokenizer(DOCS[30:36], 300)
    with pytest.raises(DataError, match="different tokenizer"):
        tokenize_to_shards(CORPUS, other, out, resume=True, **kw)
    with pytest.raises(DataError, match="different shard_tokens"):
        tokenize_to_shards(CORPUS, tok, out, resume=True, shard_tokens=999, val_fraction=0.1, progress=False)


# --------------------------------------------------------------------------- reading
@pytest.fixture(scope="module")
def shards(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    tokenize_to_shards(CORPUS, tok, d, shard_tokens=5000, val_fraction=0.1, progress=False)
    return d


def test_sample_batch(shards):
    sh = TokenShards(shards, "train")
    stream = sh.tokens(0, len(sh))
    x, y = sh.sample_batch(16, 64, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (16, 64) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x.numpy(), y.numpy()):  # every window is a real slice of the stream
        starts = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(stream, 64) == row_x, axis=1))
        assert any(np.array_equal(stream[s + 1 : s + 65], row_y) for s in starts)
    x2, _ = sh.sample_batch(16, 64, torch.Generator().manual_seed(0))
    x3, _ = sh.sample_batch(16, 64, torch.Generator().manual_seed(1))
    assert torch.equal(x, x2) and not torch.equal(x, x3)
    # Windows that cross a shard boundary read both shards.
    b = len(sh.maps[0])
    assert np.array_equal(sh.tokens(b - 3, 6), np.concatenate([sh.maps[0][-3:], sh.maps[1][:3]]).astype(np.int64))


def test_sequential_iterator(shards):
    sh = TokenShards(shards, "val")
    seq = 32
    batches = list(sh.iter_batches(4, seq))
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    n_windows = (len(sh) - 1) // seq
    assert x.shape == (n_windows, seq)
    stream = torch.from_numpy(sh.tokens(0, len(sh)))
    assert torch.equal(x.flatten(), stream[: n_windows * seq])
    assert torch.equal(y.flatten(), stream[1 : n_windows * seq + 1])  # every target exactly once
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, sh.iter_batches(4, seq)))
    r0 = list(sh.iter_batches(4, seq, rank=0, world_size=2))
    r1 = list(sh.iter_batches(4, seq, rank=1, world_size=2))
    assert len(r0) + len(r1) == len(batches) and torch.equal(r1[0][0], batches[1][0])
    assert len(list(sh.iter_batches(4, seq, max_batches=2))) == 2


def test_token_shards_errors(shards, tok, tmp_path):
    with pytest.raises(DataError, match="fewer than seq_len"):
        TokenShards(shards, "val").sample_batch(2, 10**7)
    other = train_tokenizer(DOCS[30:36], 300)
    with pytest.raises(DataError, match="shards were made with tokenizer"):
        TokenShards(shards, "train", tokenizer=other)
    with pytest.raises(DataError, match="no index.json"):
        TokenShards(tmp_path, "train")
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shards, copy)
    victim = copy / read_index(copy)["splits"]["train"]["shards"][1]["file"]
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(DataError, match=rf"{victim.name}: .* truncated"):
        TokenShards(copy, "train")
    with pytest.raises(ConfigError):
        TokenShards(shards, "test")


def test_cli_tokenize(tok_dir, tmp_path, capsys):
    out = tmp_path / "emb"
    args = [
        "data",
        "tokenize",
        "--embedded",
        "--tokenizer",
        str(tok_dir),
        "--out",
        str(out),
        "--val-fraction",
        "0.1",
        "--shard-tokens",
        "50000",
        "--no-progress",
    ]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "train:" in printed and "bytes/token" in printed
    idx = read_index(out)
    assert idx["documents_consumed"] == len(DOCS) and idx["splits"]["val"]["documents"] == 8
    assert cli_main(args) == 2  # exists: needs --resume
    assert "--resume" in capsys.readouterr().err
    assert cli_main(args + ["--resume"]) == 0
    pq.write_table(pa.table({"content": ["a"]}), tmp_path / "x.parquet")
    assert (
        cli_main(
            [
                "data",
                "tokenize",
                "--input",
                str(tmp_path / "x.parquet"),
                "--tokenizer",
                str(tok_dir),
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert "columns found: ['content']" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before any work
    jl = tmp_path / "c.jsonl"
    jl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:5]))
    assert (
        cli_main(
            [
                "data",
                "tokenize",
                "--input",
                str(jl),
                "--tokenizer",
                str(tok_dir),
                "--out",
                str(tmp_path / "j"),
                "--val-fraction",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )
    assert TokenShards(tmp_path / "j", "train").num_documents == 5


# --------------------------------------------------------------------------- one large file, validation by tokens
BOOK = "Title page.\n\n" + "".join(
    f"CHAPTER {n}.\n\n" + "\n\n".join(" ".join(DOCS[j][i : i + 300].split()) for i in range(0, 1500, 300)) + "\n\n"
    for j, n in enumerate(("I", "II", "III", "IV"))
)


def test_split_text_modes():
    from lapheads.data.text import split_documents, split_text

    chapters = split_text(BOOK, "chapters")
    assert len(chapters) == 5 and chapters[0] == "Title page.\n\n" and chapters[2].startswith("CHAPTER II.")
    assert "".join(chapters) == BOOK  # nothing lost
    paras = split_text(BOOK, "blank_lines")
    assert paras == [p for p in BOOK.split("\n\n") if p.strip()] and len(paras) > 20
    pieces = split_text(BOOK, 500)
    assert "".join(pieces) == BOOK and all(len(p) <= 500 for p in pieces) and len(pieces) >= len(BOOK) // 500
    assert all(p[-1].isspace() for p in pieces[:-1])  # cut at whitespace
    assert split_text("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]
    assert list(split_documents(["a\n\nb", "c"], "blank_lines")) == ["a", "b", "c"]
    with pytest.raises(DataError, match="no chapter heading"):
        split_text("Just a paragraph about a part of it.", "chapters", where="book.txt")
    with pytest.raises(ConfigError, match="split_documents='pages'"):
        split_text(BOOK, "pages")


def test_validation_by_tokens_on_a_single_document(tok, tmp_path):
    with pytest.raises(DataError, match="leaves no training document"):
        tokenize_to_shards([BOOK], tok, tmp_path / "docs", val_fraction=0.1, progress=False)
    index = tokenize_to_shards(
        [BOOK, DOCS[5]], tok, tmp_path / "tok", val_fraction=0.1, val_by="tokens", shard_tokens=300, progress=False
    )
    train, val = TokenShards(tmp_path / "tok", "train"), TokenShards(tmp_path / "tok", "val")
    t_docs = [tok.decode(d.tolist()) for d in _split_docs(train.tokens(0, len(train)), tok.bos_token_id)]
    v_docs = [tok.decode(d.tolist()) for d in _split_docs(val.tokens(0, len(val)), tok.bos_token_id)]
    assert [a + b for a, b in zip(t_docs, v_docs)] == [BOOK, DOCS[5]]  # head for training, tail for validation
    n = [len(tok.encode(d, add_special_tokens=False)) for d in (BOOK, DOCS[5])]
    assert val.num_tokens - 2 == sum(round(0.1 * k) for k in n)
    assert index["splits"]["train"]["bytes"] + index["splits"]["val"]["bytes"] == len(BOOK.encode()) + len(
        DOCS[5].encode()
    )
    assert index["splits"]["val"]["bytes"] == sum(len(d.encode()) for d in v_docs)
    # resume after a kill gives the same shards (each half of a document is committed separately)
    out = tmp_path / "killed"
    kw = dict(val_fraction=0.1, val_by="tokens", shard_tokens=300, progress=False, batch_documents=1)
    with pytest.raises(_Killed):
        tokenize_to_shards(_killed_after([BOOK, DOCS[5], DOCS[6]], 2), tok, out, **kw)
    tokenize_to_shards([BOOK, DOCS[5], DOCS[6]], tok, out, resume=True, **kw)
    tokenize_to_shards([BOOK, DOCS[5], DOCS[6]], tok, tmp_path / "clean", **kw)
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "clean")
    with pytest.raises(DataError, match="different val_by"):
        tokenize_to_shards([BOOK], tok, out, resume=True, val_fraction=0.1, shard_tokens=300, progress=False)


def test_train_fraction_keeps_an_even_share_of_training_documents(tok, tmp_path):
    full = tokenize_to_shards(CORPUS, tok, tmp_path / "full", val_fraction=0.1, progress=False)
    half = tokenize_to_shards(CORPUS, tok, tmp_path / "half", val_fraction=0.1, train_fraction=0.5, progress=False)
    capped = tokenize_to_shards(CORPUS, tok, tmp_path / "cap", val_fraction=0.1, max_train_documents=4, progress=False)
    n_train = full["splits"]["train"]["documents"]
    assert half["splits"]["train"]["documents"] == -(-n_train // 2)
    assert capped["splits"]["train"]["documents"] == 4
    assert half["splits"]["val"] == full["splits"]["val"]  # validation stays whole
    train_docs = [d for i, d in enumerate(CORPUS) if not is_validation_document(i, 0.1)]
    sh = TokenShards(tmp_path / "half", "train")
    got = [tok.decode(d.tolist()) for d in _split_docs(sh.tokens(0, len(sh)), tok.bos_token_id)]
    assert got == train_docs[::2]  # spread evenly over the corpus


def test_cli_tokenize_one_large_text_file(tok_dir, tmp_path, capsys):
    book = tmp_path / "book.txt"
    book.write_text(BOOK, encoding="utf-8")
    base = [
        "data",
        "tokenize",
        "--input",
        str(book),
        "--tokenizer",
        str(tok_dir),
        "--no-progress",
        "--val-fraction",
        "0.2",
    ]
    assert cli_main(base + ["--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "--split-documents" in err and "--val-by tokens" in err
    assert cli_main(base + ["--out", str(tmp_path / "b"), "--split-documents", "chapters"]) == 0
    assert read_index(tmp_path / "b")["documents_consumed"] == 5
    assert cli_main(base + ["--out", str(tmp_path / "c"), "--val-by", "tokens"]) == 0
    assert TokenShards(tmp_path / "c", "train").num_documents == 1 == TokenShards(tmp_path / "c", "val").num_documents
    assert cli_main(base + ["--out", str(tmp_path / "d"), "--split-documents", "pages"]) == 2
    assert "--split-documents='pages'" in capsys.readouterr().err


def test_lm_data_from_one_large_file(tok_dir, tmp_path):
    """`train lm` data: one .txt corpus needs split_documents or val_by tokens; the error names data.* keys."""
    from lapheads.recipes.lm import LMDataConfig, prepare_data

    book = tmp_path / "book.txt"
    book.write_text(BOOK, encoding="utf-8")
    base = dict(corpus=str(book), tokenizer=str(tok_dir), cache_dir=str(tmp_path / "cache"), val_fraction=0.2)
    with pytest.raises(DataError) as e:
        prepare_data(LMDataConfig(**base))
    assert "data.val_by: tokens" in str(e.value) and "data.split_documents" in str(e.value)
    assert "--val-fraction" not in str(e.value)  # `train lm` has no such flag
    _, by_tokens = prepare_data(LMDataConfig(**base, val_by="tokens"))
    assert TokenShards(by_tokens, "train").num_documents == 1 == TokenShards(by_tokens, "val").num_documents
    _, chapters = prepare_data(LMDataConfig(**base, split_documents="chapters"))
    assert read_index(chapters)["documents_consumed"] == 5 and chapters != by_tokens
    _, half = prepare_data(LMDataConfig(**base, split_documents="blank_lines", fraction=0.5))
    _, whole = prepare_data(LMDataConfig(**base, split_documents="blank_lines"))
    assert TokenShards(half, "val").num_tokens == TokenShards(whole, "val").num_tokens
    assert TokenShards(half, "train").num_documents == -(-TokenShards(whole, "train").num_documents // 2)
    with pytest.raises(ConfigError, match="data.split_documents='pages'"):
        prepare_data(LMDataConfig(**base, split_documents="pages"))
    with pytest.raises(ConfigError, match="data.fraction applies when the shards are built"):
        prepare_data(LMDataConfig(shards=str(whole), tokenizer=str(tok_dir), fraction=0.5))
