"""The ``lapheads`` command line: :data:`COMMANDS` names each command's function in :mod:`lapheads.commands`,
imported only when it runs; errors are one line (``--debug``: the traceback). Design notes: ``docs/design/lm.md``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import signal
import sys
import threading
import warnings
from typing import Optional, Sequence

from . import __version__
from .errors import ConfigError, LapheadsError, NonFiniteError

_C = "lapheads.commands."
# (words...) -> ("module:function", one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("quickstart",): (_C + "quickstart:main", "baseline vs Laplacian heads on embedded data, with a report"),
    ("recipes",): (_C + "recipes:main", "the shipped recipe configs (--config NAME), one line each"),
    ("train", "classify"): (_C + "train:classify", "DeiT-3 supervised classification"),
    ("train", "lm"): (_C + "train:lm", "NanoChat-style language-model pretraining"),
    ("train", "sft"): (_C + "train:sft", "supervised fine-tuning on chat JSONL"),
    ("train", "dino"): (_C + "train:dino", "DINO self-supervised pretraining"),
    ("train", "retrofit"): (
        _C + "train:retrofit",
        "switch k heads of a pretrained LM to Laplacian and fine-tune (full or LoRA)",
    ),
    ("train", "retrofit_vit"): (
        _C + "train:retrofit_vit",
        "switch k heads of a pretrained timm ViT to Laplacian and fine-tune (full or LoRA)",
    ),
    ("eval", "classify"): (_C + "eval:classify_main", "top-1/top-5/per-class accuracy of a run"),
    ("eval", "lm"): (_C + "eval:lm_main", "chat benchmarks (ARC, MMLU, GSM8K, HumanEval) and lm-eval"),
    ("lm-eval",): (_C + "lm_eval:main", "lm-evaluation-harness's own CLI with Laplacian heads registered"),
    ("eval", "knn"): (_C + "probes:knn_main", "weighted k-NN on frozen features"),
    ("eval", "linear"): (_C + "probes:linear_main", "linear probe on frozen features"),
    ("eval", "segment"): (_C + "probes:segment_main", "linear segmentation probe (mIoU)"),
    ("tokenizer", "train"): (_C + "data:tokenizer_main", "train a byte-level BPE tokenizer"),
    ("data", "tokenize"): (_C + "data:tokenize_main", "text/JSONL/parquet -> token shards"),
    ("sample",): (_C + "sample:main", "sample text from a language-model run"),
    ("analyze",): (_C + "analyze:main", "token-geometry analysis of runs or models"),
    ("pca-maps",): (_C + "pca_maps:main", "PCA maps of patch tokens as RGB images"),
    ("sweep",): (_C + "sweep:main", "run a recipe over Laplacian-head settings and seeds"),
    ("report",): (_C + "report:main", "Markdown + HTML report comparing runs"),
    ("config", "show"): (_C + "config:show_main", "print a recipe's config as YAML (defaults or resolved)"),
    ("config", "schema"): (_C + "config:schema_main", "print the JSON schema of a recipe's config"),
}


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that clean-up runs and the run can name its checkpoint."""

    signum = signal.SIGTERM


def _sigterm_as_interrupt() -> Optional[object]:
    """Raise :class:`_Terminated` on SIGTERM (when nobody else handles it); returns the old handler."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        return None

    def _raise(signum: int, frame: object) -> None:
        raise _Terminated()

    return signal.signal(signal.SIGTERM, _raise)


# what quiets the libraries, set only where the user has not set it: huggingface_hub, transformers
# and datasets read these when they are imported; tqdm reads TQDM_* as the defaults of every bar
_QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TQDM_DISABLE": "1",
}


def quiet_libraries(verbose: bool, interactive: bool) -> None:
    """Unless ``verbose`` or ``interactive`` (stderr a terminal), keep the libraries' progress bars, info logs
    and warnings out of log files and pipes (``docs/design/lm.md``); ``verbose`` reaches child processes as
    ``LAPHEADS_VERBOSE=1``."""
    if verbose:
        os.environ["LAPHEADS_VERBOSE"] = "1"
        return
    if interactive:
        return
    for name, value in _QUIET_ENV.items():
        os.environ.setdefault(name, value)
    warnings.filterwarnings("ignore", module=r"(?!lapheads(\.|$))")


def _usage() -> str:
    width = max(len(" ".join(k)) for k in COMMANDS)
    lines = ["usage: lapheads <command> [options]   (add --help after a command for its options)", "", "commands:"]
    for words, (_, help_) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<{width}}  {help_}")
    lines += [
        "",
        "global options:",
        "  --debug     show full tracebacks",
        "  --verbose   keep the libraries' progress bars and warnings in log files and pipes too",
        "  --version   print the version",
    ]
    return "\n".join(lines)


def _group_usage(group: str) -> str:
    """The help of a command group (``lapheads train --help``): its commands, one line each."""
    words = [k for k in COMMANDS if len(k) == 2 and k[0] == group]
    width = max(len(k[1]) for k in words)
    lines = [f"usage: lapheads {group} <{'|'.join(k[1] for k in words)}> [options]", "", "commands:"]
    lines += [f"  {k[1]:<{width}}  {COMMANDS[k][1]}" for k in words]
    lines += ["", f"add --help after one for its options (lapheads {group} {words[0][1]} --help)"]
    return "\n".join(lines)


def _find(argv: Sequence[str]) -> tuple[Optional[tuple[str, ...]], list[str]]:
    for n in (2, 1):
        key = tuple(argv[:n])
        if key in COMMANDS:
            return key, list(argv[n:])
    return None, list(argv)


def _out_arg(args: Sequence[str]) -> Optional[str]:
    """The value of ``--out`` in ``args`` (``--out X`` or ``--out=X``), or None."""
    for i, a in enumerate(args):
        if a == "--out" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--out="):
            return a.split("=", 1)[1]
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("LAPHEADS_DEBUG") == "1"
    argv = [a for a in argv if a not in ("--debug", "--verbose")]  # --verbose: read by entry()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        print(__version__)
        return 0
    key, rest = _find(argv)
    if key is None:
        group = [k for k in COMMANDS if len(k) == 2 and k[0] == argv[0]]
        if group and argv[1:2] and argv[1] in ("-h", "--help", "help"):
            print(_group_usage(argv[0]))
            return 0
        if group:
            subs = ", ".join(k[1] for k in group)
            print(
                f"lapheads: error: '{argv[0]}' needs one of: {subs} (see 'lapheads {argv[0]} --help')", file=sys.stderr
            )
        else:
            print(f"lapheads: error: unknown command {argv[0]!r}; run 'lapheads --help' for the list", file=sys.stderr)
        return 2
    mod_name, fn_name = COMMANDS[key][0].split(":")

    def _argparse_error(parser: argparse.ArgumentParser, message: str):
        # argparse would print the whole usage block; one line naming the flag is the rule here
        raise ConfigError(f"{message} (see '{parser.prog} --help')")

    saved_error = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _argparse_error  # type: ignore[method-assign]
    saved_term = _sigterm_as_interrupt()
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
        if key[0] != "train":  # training commands choose threads from their config (train.threads)
            from .engine.threads import configure_threads  # lazy: torch is imported only when a command runs

            configure_threads()
        return int(fn(rest) or 0)
    except (LapheadsError, NonFiniteError) as e:  # a non-finite guard stop is no input error: status 1
        if debug:
            raise
        return _error_line(key, " ".join(str(e).split()), 1 if isinstance(e, NonFiniteError) else 2)
    except OSError as e:  # a full disk outside a run's own writes (a report, figures, geometry): one line
        from .errors import free_bytes, human_bytes, is_disk_full

        if debug or not is_disk_full(e):
            raise
        where = e.filename or _out_arg(rest)  # a write through a file object names no file: the --out folder
        free = f" ({human_bytes(free_bytes(where))} free)" if where else ""
        msg = f"no space left on the disk of {where or 'the output'}{free}; "
        return _error_line(key, msg + "free space or write elsewhere, then run the command again", 2)
    except ModuleNotFoundError as e:  # an optional extra is not installed (lapheads.extras)
        from .extras import missing_extra_message

        msg = missing_extra_message(e)
        if msg is None or debug:
            raise
        return _error_line(key, msg, 2)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: one line with the resume command
        from .engine.launch import describe_interrupt  # lazy, as above

        line, rc = describe_interrupt(key, rest, e)
        if line:
            print(line, file=sys.stderr)
        return rc
    finally:
        argparse.ArgumentParser.error = saved_error  # type: ignore[method-assign]
        if saved_term is not None:
            signal.signal(signal.SIGTERM, saved_term)


def _error_line(key: tuple[str, ...], message: str, rc: int) -> int:
    """Print ``lapheads <command>: error: <message>`` to stderr; returns ``rc``."""
    print(f"lapheads {' '.join(key)}: error: {message}", file=sys.stderr)
    return rc


def entry() -> int:
    """Console-script entry: ``main`` with the libraries quiet in logs and pipes (:func:`quiet_libraries`),
    plus a quiet exit when the output pipe closes (``| head``)."""
    verbose = "--verbose" in sys.argv[1:] or os.environ.get("LAPHEADS_VERBOSE") == "1"
    quiet_libraries(verbose, interactive=sys.stderr.isatty())
    try:
        return main()
    except BrokenPipeError:
        sys.stderr.close()
        return 141
    finally:
        _spare_the_exit_collections()


def _spare_the_exit_collections() -> None:
    """Exit without the shutdown collections of every object the imports made (seconds with torch loaded)."""
    gc.collect()
    gc.freeze()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(entry())
