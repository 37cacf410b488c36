"""``lapheads lm-eval ...``: lm-evaluation-harness's own command line, with Laplacian heads registered.

Every argument is lm-eval's (``lapheads lm-eval --model lapheads --model_args pretrained=RUN/final/hf
--tasks arc_easy``, ``lapheads lm-eval ls tasks``); lapheads' chat tasks are indexed too. Design notes:
``docs/design/lm.md``.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from .. import transformers  # noqa: F401  (registers the Laplacian attention implementation)
from ..errors import ConfigError
from ..lm.tasks import TASKS_DIR

__all__ = ["main"]

PROG = "lapheads lm-eval"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run lm-eval's command line on ``argv`` with :mod:`lapheads.transformers` imported.

    Raises:
        ConfigError: lm-evaluation-harness (or ``accelerate``, which its ``HFLM`` needs) is not installed.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # optional dependencies (the eval extra): imported when the command runs
        from lm_eval._cli.harness import HarnessCLI
        from lm_eval.utils import setup_logging  # lazy: optional dependency (the eval extra)
    except ImportError as e:
        raise ConfigError(f"lapheads lm-eval needs lm-evaluation-harness ({e}); pip install 'lapheads[eval]'") from None
    try:
        import accelerate  # noqa: F401 - HFLM imports it when a model is built
    except ImportError:
        raise ConfigError(
            "lapheads lm-eval needs accelerate for lm-eval's HFLM; pip install 'lapheads[eval]'"
        ) from None

    from ..lm import hflm  # noqa: F401 - registers --model lapheads (imports lm-eval: the eval extra)

    setup_logging()
    cli = HarnessCLI()
    # argparse messages name this command (cosmetic; lm-eval keeps its parsers in private attributes)
    parser, subs = getattr(cli, "_parser", None), getattr(cli, "_subparsers", None)
    if parser is not None:
        parser.prog = PROG
    for name, sub in (getattr(subs, "choices", None) or {}).items():
        sub.prog = f"{PROG} {name}"
    # HarnessCLI.parse_args reads sys.argv (and inserts the legacy "run"); give it ours.
    saved = sys.argv
    sys.argv = [PROG, *argv]
    try:
        args = cli.parse_args()
    finally:
        sys.argv = saved
    if hasattr(args, "include_path"):  # run / ls / validate: index lapheads' chat tasks too
        args.include_path = [str(TASKS_DIR)] + ([args.include_path] if args.include_path else [])
    cli.execute(args)
    return 0
