"""``lapheads lm-eval ...``: lm-evaluation-harness's own command line, with Laplacian heads registered.

``lapheads lm-eval --model lapheads --model_args pretrained=runs/lm/final/hf --tasks arc_easy,mmlu,wikitext``
``lapheads lm-eval run --model lapheads --model_args pretrained=RUN/final/hf --tasks humaneval --confirm_run_unsafe_code``
``lapheads lm-eval ls tasks``

Design choices:

* Every argument is lm-eval's (``lm-eval --help``): this command only imports
  :mod:`lapheads.transformers` first, then hands the argument list to lm-eval's own parser
  (``lm_eval._cli.HarnessCLI``, the object behind the ``lm-eval`` / ``lm_eval`` console script). The
  import registers the attention implementation that an exported run's ``config.json`` names
  (``"laplacian_sdpa (import lapheads.transformers first)"``), so lm-eval's ``HFLM`` (``--model hf``)
  builds the model with its Laplacian heads through plain ``AutoModelForCausalLM.from_pretrained``.
* ``--model lapheads`` (same ``--model_args`` as ``hf``) is :class:`lapheads.lm.hflm.LapheadsHFLM`,
  registered in lm-eval's model registry under a name of its own: ``HFLM`` whose rolling
  log-likelihoods (perplexity tasks) score a document after one BOS, as ``lapheads eval lm`` does.
  ``--model hf`` is left as lm-eval defines it: with this project's tokenizer (which adds BOS, as
  Llama's does) it scores rolling documents after two BOS (see :mod:`lapheads.lm.hflm`); its
  ``loglikelihood`` and ``generate_until`` requests equal ``--model lapheads``'s.
  Nothing else of lm-eval is patched: task selection, few-shot, batching, generation, output
  files, caching, W&B logging and the unsafe-code confirmation of code tasks
  (``--confirm_run_unsafe_code`` for humaneval / mbpp) behave exactly as in ``lm-eval``.
* lapheads' chat tasks (:mod:`lapheads.lm.tasks`: ``lapheads_chat_arc_easy``, ``..._arc_challenge``,
  ``..._mmlu``, ``..._gsm8k``, ``..._humaneval``, tag ``lapheads_chat``) are always indexed: their
  directory is put before ``--include_path`` (lm-eval's ``TaskManager`` takes a list of
  directories, later ones overriding a task name). They read the Hub data sets their YAML names.
  ``lapheads_chat_humaneval`` runs every program in :mod:`lapheads.sandbox` and refuses where
  bubblewrap cannot run (lm-eval's ``--confirm_run_unsafe_code`` does not lift that; ``lapheads
  eval lm --confirm-run-unsafe-code`` does).
* The network is not forced off (``lapheads eval lm`` does that; here lm-eval's own conventions
  hold): set ``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1`` to evaluate local task YAML files
  (``--include_path DIR``) without reaching the hub.
* lm-eval's legacy form without a subcommand (``lapheads lm-eval --model hf ...``) is accepted,
  as ``lm-eval`` accepts it; an argparse error is one line with exit status 2, like every other
  ``lapheads`` command.
* ``HFLM`` needs ``accelerate``; both are in the ``eval`` extra (``pip install 'lapheads[eval]'``).
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
