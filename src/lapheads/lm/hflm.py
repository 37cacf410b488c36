"""lm-evaluation-harness's ``HFLM`` for lapheads models, with one BOS in every request type.

``lapheads eval lm --lm-eval ...`` evaluates through :class:`LapheadsHFLM`, and ``lapheads lm-eval
--model lapheads --model_args pretrained=RUN/final/hf ...`` names it on lm-eval's own command line
(the module registers it in lm-eval's model registry as ``lapheads``). It imports lm-eval (the
``eval`` extra). Why the subclass: ``docs/design/lm.md``.
"""

from __future__ import annotations

from typing import Any

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

    def tok_encode(self, string: str, *args: Any, **kwargs: Any) -> list[int]:
        ids = super().tok_encode(string, *args, **kwargs)
        if self._encoding_rolling_document and ids[:1] == [self.prefix_token_id]:
            ids = ids[1:]  # lm-eval's prefix token is the document's BOS
        return ids
