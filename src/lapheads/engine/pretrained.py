"""Models from outside this project's runs, for analysis (``lapheads analyze --checkpoint``): a
transformers checkpoint directory or a timm model name with a state dict.
Design notes: docs/design/engine.md (Pretrained models)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import CheckpointError, ConfigError

__all__ = ["load_checkpoint"]


def load_checkpoint(
    spec: str, weights: Optional[str] = None, model_args: Optional[dict[str, Any]] = None
) -> tuple[torch.nn.Module, str, Any]:
    """Load ``spec`` -> (model, kind "vit" | "hf", tokenizer or None).

    Args:
        spec: a transformers checkpoint directory or a timm model name.
        weights: timm only: a ``.safetensors`` / ``.pt`` / ``.pth`` state dict.
        model_args: timm only: keyword arguments of ``timm.create_model``.
    """
    p = Path(spec)
    if p.exists():
        import transformers  # imported here: a timm model needs neither transformers nor its integration

        from .. import transformers as lap_tf

        if not (p.is_dir() and (p / "config.json").is_file()):
            raise CheckpointError(
                f"{spec}: not a transformers checkpoint directory (no config.json); "
                "give a directory saved with save_pretrained or a timm model name"
            )
        if weights:
            raise ConfigError("--weights is for timm models; a transformers directory holds its weights")
        cfg = transformers.AutoConfig.from_pretrained(p)
        causal = any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in (cfg.architectures or []))
        cls = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
        try:  # lapheads' loader restores the attention implementation its config names
            model = lap_tf.from_pretrained(str(p), model_class=cls)
        except Exception as e:  # noqa: BLE001 - report any loader failure as a checkpoint error
            raise CheckpointError(f"{spec}: cannot load the model: {e}") from e
        tok = None
        if any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
            try:
                tok = transformers.AutoTokenizer.from_pretrained(p)
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{spec}: cannot load the tokenizer: {e}") from e
        return model, "hf", tok
    import timm

    if not timm.is_model(spec):
        close = timm.list_models(f"*{spec.split('.')[0][:12]}*")[:8]
        raise CheckpointError(
            f"{spec!r} is neither an existing directory nor a timm model name"
            + (f"; similar timm names: {', '.join(close)}" if close else "")
        )
    try:
        vit: torch.nn.Module = timm.create_model(spec, pretrained=False, **(model_args or {}))
    except TypeError as e:
        raise ConfigError(f"--model-args not accepted by timm model {spec}: {e}") from e
    if weights:
        wp = Path(weights)
        if not wp.is_file():
            raise CheckpointError(f"--weights {weights}: no such file")
        try:
            sd: Any
            if wp.suffix == ".safetensors":
                from safetensors.torch import load_file

                sd = load_file(str(wp))
            else:
                sd = torch.load(wp, map_location="cpu", weights_only=True)
                sd = sd.get("model", sd) if isinstance(sd, dict) else sd
            vit.load_state_dict(sd)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"--weights {weights}: does not fit {spec} (check --model-args): {str(e)[:400]}"
            ) from e
    return vit, "vit", None
