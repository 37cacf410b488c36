"""lm-evaluation-harness's ``HFLM`` for lapheads models, with one BOS in every request type.

``lapheads eval lm --lm-eval ...`` evaluates through :class:`LapheadsHFLM`, and ``lapheads lm-eval
--model lapheads --model_args pretrained=RUN/final/hf ...`` names it on lm-eval's own command line
(the module registers it in lm-eval's model registry as ``lapheads``).

Design choices:

* It is lm-eval's ``HFLM`` (batching, log-likelihoods, ``generate_until`` with stop sequences,
  left truncation, caching) with one method changed. The Laplacian heads come from the model
  itself: importing :mod:`lapheads.transformers` registers the attention implementation that an
  exported run's ``config.json`` names, so ``HFLM(pretrained=path)`` and ``HFLM(pretrained=model)``
  both run the Laplacian model.
* Why a subclass at all: this project's tokenizer prefixes ``<|bos|>`` (every pretraining
  document starts with it), and ``HFLM`` (lm-eval 0.4.13) encodes a request's text with the
  tokenizer's default in all three request types. That gives one BOS to ``loglikelihood`` (also
  for an empty context, where lm-eval puts its ``prefix_token_id`` = BOS before the bare
  continuation) and to ``generate_until``, but two to ``loglikelihood_rolling``: it puts
  ``prefix_token_id`` before ``tok_encode(document)``, which already starts with BOS, so the BOS
  after BOS is scored as the document's first token (several nats per document). The rolling
  path and the ``loglikelihood`` context make the very same ``tok_encode(text)`` call, so no
  tokenizer or config setting can give both exactly one BOS (a tokenizer that adds none leaves
  ``loglikelihood`` and generation without BOS; ``add_bos_token`` feeds both calls alike). Models
  whose tokenizers add BOS (Llama, Gemma) get the same double BOS from plain ``HFLM``.
* The change: while a rolling request is encoded, a leading ``prefix_token_id`` is dropped from
  the document's ids, so lm-eval's own prefix is the only BOS. Only a token equal to the prefix is
  dropped, so a tokenizer that adds no BOS is scored exactly as ``HFLM`` scores it.
* ``max_gen_toks`` is an argument (``HFLM`` 0.4.13 fixes its default at 256 and ignores the keyword
  for a model passed as an object): the number of new tokens of a ``generate_until`` request whose
  task does not set its own, as ``lapheads eval lm --max-new-tokens`` sets it.
* This module imports lm-eval at import time; it is imported only where lm-eval is needed
  (``pip install 'lapheads[eval]'``, which also brings ``accelerate`` for ``HFLM``).
"""

from __future__ import annotations

from typing import Any, Optional

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from .. import transformers  # noqa: F401  (registers the Laplacian attention implementation)

__all__ = ["MODEL_NAME", "LapheadsHFLM"]

#: The name under which lm-eval's registry (``--model``) knows :class:`LapheadsHFLM`.
MODEL_NAME = "lapheads"


@register_model(MODEL_NAME)
class LapheadsHFLM(HFLM):
    """``HFLM`` whose rolling log-likelihoods score a document after exactly one BOS.

    Takes every argument of lm-eval's ``HFLM`` (``pretrained`` a path or a loaded model,
    ``tokenizer``, ``batch_size``, ``max_length``, ``device``, ``dtype`` ...), and
    ``max_gen_toks``: new tokens of a ``generate_until`` request whose task sets none (default 256).
    """

    def __init__(self, *args: Any, max_gen_toks: int = 256, **kwargs: Any) -> None:
        self._encoding_rolling_document = False
        self._default_max_gen_toks = int(max_gen_toks)
        super().__init__(*args, **kwargs)

    @property
    def max_gen_toks(self) -> int:
        return self._default_max_gen_toks

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        # HFLM encodes each document with tok_encode(document) and puts prefix_token_id before it;
        # the flag tells tok_encode that this call is that document.
        self._encoding_rolling_document = True
        try:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        finally:
            self._encoding_rolling_document = False

    def tok_encode(
        self,
        string: str,
        add_special_tokens: Optional[bool] = None,
        left_truncate_len: Optional[int] = None,
        **kwargs: Any,
    ) -> list[int]:
        ids = super().tok_encode(
            string, add_special_tokens=add_special_tokens, left_truncate_len=left_truncate_len, **kwargs
        )
        if self._encoding_rolling_document and ids[:1] == [self.prefix_token_id]:
            ids = ids[1:]  # lm-eval's prefix token is the document's BOS
        return ids
