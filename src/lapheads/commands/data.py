"""``lapheads tokenizer train`` and ``lapheads data tokenize``: a tokenizer and token shards from text.

Both read text, JSONL and parquet files, the embedded corpus, or one Hugging Face dataset
(``--input hf:PATH_OR_NAME``: a ``save_to_disk`` directory, data files, or a Hub name, resolved as
``datasets`` resolves it; ``--hf-split``, ``--hf-name``, ``--streaming``), the same sources the
``lm`` recipe's ``data.corpus`` takes."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from ..data import text as text_data
from ..data.shards import INDEX_NAME, SPLITS, tokenize_to_shards
from ..data.text import check_inputs, check_split_mode, embedded_documents, iter_documents, split_documents
from ..engine.config import number_arg
from ..errors import ConfigError
from ..lm.tokenizer import _MIN_VOCAB, load_tokenizer, tokenizer_hash, train_tokenizer
from ..outputs import check_out_dir, removed_on_failure
from . import opts

# --------------------------------------------------------------------------- inputs
_INPUT_HELP = (
    "text (.txt: one document per file), JSONL (.jsonl[.gz]: one per line) or parquet "
    "(.parquet with a text column, FineWeb-Edu's layout) files, in this order; or one Hugging Face "
    "dataset, hf:PATH_OR_NAME (save_to_disk directory, data files, or a Hub name)"
)


def _add_sources(ap: argparse.ArgumentParser, embedded_help: str) -> None:
    """``--input`` or ``--embedded`` (one of them required)."""
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="FILE", help=_INPUT_HELP)
    src.add_argument("--embedded", action="store_true", help=embedded_help)


def _add_text_options(ap: argparse.ArgumentParser) -> None:
    """``--text-field`` and the options of an ``hf:`` input."""
    ap.add_argument("--text-field", default="text", help="JSONL key / parquet / hf: column holding the text")
    ap.add_argument("--hf-split", default="train", help="--input hf:...: the split read (default train)")
    ap.add_argument("--hf-name", default="", help="--input hf:...: the dataset's configuration (subset) name")
    ap.add_argument(
        "--streaming",
        action="store_true",
        help="--input hf:...: stream the rows instead of loading the dataset (corpora larger than memory)",
    )


def _input_documents(args: argparse.Namespace) -> tuple[Iterable[str], Optional[int], str]:
    """``(documents, number of documents or None, source)`` of ``--embedded`` or ``--input`` (files or ``hf:``)."""
    if args.embedded:
        from pydoc_data.topics import topics  # lazy: a 0.8 MB module, only for the embedded corpus

        return embedded_documents(), len(topics), "pydoc_data.topics"
    hf = [p for p in args.input if text_data.hf_source(p) is not None]
    if not hf:
        check_inputs(args.input, text_field=args.text_field)
        return iter_documents(args.input, text_field=args.text_field), None, ", ".join(str(p) for p in args.input)
    if len(args.input) != 1:
        raise ConfigError(f"--input {hf[0]}: give one Hugging Face dataset and no other input (got {len(args.input)})")
    spec = args.input[0]
    ds = text_data.open_hf_dataset(
        str(text_data.hf_source(spec)), args.hf_split, args.hf_name or None, streaming=args.streaming, what="--input"
    )
    text_data.check_hf_column(ds, args.text_field, f"--input {spec}", "--text-field")
    total = None if args.streaming else len(ds)
    return text_data.read_hf_dataset(ds, args.text_field, spec), total, spec


def tokenizer_main(argv: Optional[Sequence[str]] = None) -> int:
    """``lapheads tokenizer train``: train a byte-level BPE tokenizer and save it."""
    ap = argparse.ArgumentParser(
        prog="lapheads tokenizer train",
        description="Train a byte-level BPE tokenizer (nanochat's special tokens + <|pad|>) and save it as a "
        "transformers tokenizer directory (AutoTokenizer.from_pretrained(DIR) loads it).",
    )
    _add_sources(ap, "train on the corpus that ships with Python (pydoc_data.topics, ~0.5M characters)")
    ap.add_argument(
        "--vocab-size",
        type=number_arg(int, ge=1),
        required=True,
        help=f"total vocabulary (>= {_MIN_VOCAB}); nanochat uses 65536, the embedded corpus supports "
        "~1000-4000 before merges become rare",
    )
    ap.add_argument("--out", required=True, help="output directory")
    _add_text_options(ap)
    ap.add_argument(
        "--max-chars",
        type=number_arg(int, ge=1),
        help="stop reading after this many characters (nanochat trains on ~2B); default: all",
    )
    args = ap.parse_args(list(argv) if argv is not None else None)

    check_out_dir(args.out)
    docs, _, source = _input_documents(args)
    if args.max_chars is not None:
        docs = text_data.limit_chars(docs, args.max_chars)
    with removed_on_failure(args.out):
        tok = train_tokenizer(docs, args.vocab_size, args.out)
    print(f"tokenizer: vocab {len(tok)} trained on {source} -> {args.out} (hash {tokenizer_hash(tok)})")
    return 0


def _split_arg(text: str) -> Any:
    try:
        return check_split_mode(text, "--split-documents")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def tokenize_main(argv: Optional[Sequence[str]] = None) -> int:
    """``lapheads data tokenize``: text/JSONL/parquet (or the embedded corpus) -> token shards."""
    ap = argparse.ArgumentParser(
        prog="lapheads data tokenize",
        description="Tokenize a corpus into BOS-prefixed uint16/uint32 token shards with a validation split "
        "(by document) and an index.json holding the statistics bits-per-byte needs. "
        "Interrupted runs continue with --resume.",
    )
    _add_sources(ap, "the corpus that ships with Python (pydoc_data.topics)")
    ap.add_argument("--tokenizer", required=True, help="directory written by `lapheads tokenizer train`")
    ap.add_argument("--out", required=True, help="output directory for the shards and index.json")
    ap.add_argument(
        "--val-fraction",
        type=number_arg(float, ge=0.0, lt=1.0),
        default=0.05,
        help="fraction of documents held out for validation (default 0.05; the first document is "
        "always validation when > 0)",
    )
    ap.add_argument(
        "--shard-tokens",
        type=number_arg(int, ge=1),
        default=2**24,
        help="tokens per shard (default 16M = 32 MB at uint16); smaller shards resume with less lost work",
    )
    _add_text_options(ap)
    ap.add_argument(
        "--split-documents",
        type=_split_arg,
        metavar="blank_lines|chapters|N",
        help="cut every input document (e.g. one large .txt file) into several: at blank lines, "
        "before chapter headings, or into pieces of about N characters",
    )
    ap.add_argument(
        "--val-by",
        choices=["documents", "tokens"],
        default="documents",
        help="validation split by whole documents (default) or by the last --val-fraction of the "
        "tokens of every document (works for a single document)",
    )
    ap.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(list(argv) if argv is not None else None)

    check_out_dir(args.out)
    tok = load_tokenizer(args.tokenizer)
    docs, total, source = _input_documents(args)
    if args.split_documents is not None:
        docs = split_documents(docs, args.split_documents, source)
        total = None
    # A failed fresh run leaves nothing (not even an empty folder); a resumed one keeps its shards,
    # which its index.json lists. Ctrl-C keeps everything: --resume continues it.
    with removed_on_failure(args.out, remove_new_entries=not args.resume):
        settings = opts(args, "shard_tokens val_fraction resume val_by")
        index = tokenize_to_shards(
            docs, tok, args.out, total_documents=total, source=source, progress=not args.no_progress, **settings
        )
    for s in SPLITS:
        sp = index["splits"][s]
        bpt = sp["bytes_per_token"]
        print(
            f"{s}: {sp['documents']} documents, {sp['tokens']} tokens in {len(sp['shards'])} shard(s), "
            f"{'-' if bpt is None else f'{bpt:.3f}'} bytes/token"
        )
    print(f"index: {Path(args.out) / INDEX_NAME} ({index['dtype']}, tokenizer {index['tokenizer_hash']})")
    return 0
