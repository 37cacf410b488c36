"""Which Hugging Face transformers model types get Laplacian heads: a table measured, never written by hand.

``python -m tools.coverage transformers --write docs/coverage-transformers.md`` builds the table
and writes it as Markdown; a test regenerates it and fails when the committed file differs
(tests/test_transformers_coverage.py). The row, the status words, the comparison of outputs and
the Markdown are :mod:`tools.coverage.table`'s, shared with the timm table.

Design choices (:func:`transformers_coverage`):

* **Which model types.** Every key of transformers' auto config mapping (``CONFIG_MAPPING_NAMES``)
  whose modeling file dispatches attention through ``AttentionInterface`` (its source calls
  ``ALL_ATTENTION_FUNCTIONS.get_interface(``: the test transformers itself applies in
  ``PreTrainedModel._can_set_attn_implementation``), plus the composite models that have no
  attention class of their own and are built from towers of other model types (LLaVA: a CLIP
  vision tower and a Llama decoder). The files are read as text, nothing is imported for this.
* **Families, one representative each.** Building and checking ~600 model types tiny takes
  minutes on one core, far over the ~40 s the test may take, so the types are grouped into
  attention families read from the same source text: the keyword arguments the model hands to
  the attention function beyond the common ones (``softcap``, ``s_aux``, ``position_bias``,
  ``sliding_window``, ...), whether its attention modules carry ``layer_idx``, whether the file
  has cross-attention, and whether the config is composite (``sub_configs_defaults``). These are
  exactly what decides how :mod:`lapheads.transformers` has to treat a call, so the types of one
  family reach the attention function the same way. The representative is the first member
  named in :data:`PREFERRED` (well-known models), else the members in alphabetical order; the
  first that builds tiny offline is checked (at most :data:`MAX_TRIES` tries per family).
* **Tiny offline build.** ``AutoConfig.for_model(type)`` (the class defaults, no download), every
  size attribute shrunk (:data:`_SIZES`: hidden 32, 2 layers, 4 heads of 8, vocabulary 99, images
  of 32 px in 8 px patches, 4 experts, ...; any other ``*_dim`` / ``*_size`` / ``*_rank`` above 64
  to 32), per-layer lists cut to the new depth, token ids kept inside the vocabulary, recursively
  through sub-configs; the model is built in float64 by the first auto class that knows the type
  (:data:`_AUTO_CLASSES`, ``AutoModel`` first; a type none knows is a sub-config, covered by its
  parent), and one over :data:`MAX_PARAMS` parameters on the meta device is not built. Inputs are
  a right-padded batch of token ids, images, audio samples / features or video frames, as the
  model's main input asks; an image-text model whose image tokens the generic ids lack runs on
  its text inputs (the status says so; its vision tower's type has a family of its own). A type
  whose config or inputs need more (timm backbones, a download, flattened patches) is reported
  "not built" with the reason, and the next member of its family is tried.
* **Check** (:func:`check_transformers_model`): ``k = 1`` Laplacian head per layer on the fused
  implementation must equal the eager twin (the explicit ``I - P`` operator, a separate code
  path: :func:`lapheads.laplacian_attention_reference`) to 1e-9 (1e-5 for a model that keeps
  modules in float32, e.g. routers and convolutions, whose rounding differs between the two),
  differ from the stock model (else "silently standard"), ``k = 0`` must be bit-identical
  (``torch.equal``) to the stock model, and ``save_pretrained`` then
  :func:`lapheads.transformers.from_pretrained` must give the same outputs to 1e-12 (several
  stock models reload 1e-16 apart without lapheads, with an identical state dict), while a plain
  ``from_pretrained`` must either give them too or raise (never a standard model). Where the
  stock tiny model itself does not save and reload (a generic-config artefact), the reload check
  is skipped and the detail says so. A :class:`lapheads.errors.ConfigError` anywhere is "refused"
  with its message; anything else is "failed", which the test does not accept.
* **Time.** Family scan ~1 s; the whole table ~11 s of CPU on one core (~20-30 s wall on a shared
  machine), most of it importing the representatives' modeling files.
* **Deterministic text.** Fixed seeds, float64, sorted families; messages lose memory addresses
  and are cut to one line, so the same code gives the same file.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import re
import tempfile
import time
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from .table import Row, equal, markdown, max_diff, one_line, tensors

__all__ = [
    "transformers_families",
    "transformers_coverage",
    "transformers_markdown",
    "check_transformers_model",
    "build_tiny_transformers_model",
]


# =========================================================================== transformers
#: Representatives tried first when a family contains them (well-known models; the issue's list).
PREFERRED = (
    "llama",
    "mistral",
    "gemma2",
    "gpt_oss",
    "t5",
    "bart",
    "vit",
    "dinov2_with_registers",
    "clip",
    "siglip",
    "bert",
    "llava",
    "whisper",
    "detr",
    "wav2vec2",
    "modernbert",
    "videoprism",
    "gemma3",
    "qwen2_5_vl",
    "deepseek_v32",
    "pix2struct",
    "t5gemma",
)
#: At most this many members of a family are tried before it is reported "not built".
MAX_TRIES = 6
#: A tiny build over this many parameters (counted on the meta device first) is not built.
MAX_PARAMS = 2_000_000

# keyword arguments every attention call may carry and that do not change the attention itself
_COMMON_KWARGS = frozenset(
    {
        "dropout",
        "scaling",
        "is_causal",
        "attention_mask",
        "position_ids",
        "output_attentions",
        "query",
        "key",
        "value",
        "deterministic",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
    }
)
_CROSS = re.compile(r"is_cross_attention|key_value_states|EncDecAttention|encoder_attn|CrossAttention")
_OWN_ATTENTION = re.compile(r"^class \w*Attention\w*\(nn\.Module\)", re.M)

_SIZES: dict[str, int] = {}
for _k in ("hidden_size", "d_model", "n_embd", "embed_dim", "projection_dim", "text_embed_dim", "vision_embed_dim"):
    _SIZES[_k] = 32
for _k in ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers", "num_decoder_layers"):
    _SIZES[_k] = 2
for _k in ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads"):
    _SIZES[_k] = 4
for _k in ("intermediate_size", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner"):
    _SIZES[_k] = 64
_SIZES.update(
    num_key_value_heads=2,
    head_dim=8,
    d_kv=8,
    vocab_size=99,
    image_size=32,
    patch_size=8,
    num_experts=4,
    n_routed_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    max_position_embeddings=128,
)
_SIZES.update(
    max_source_positions=16,
    num_frames=2,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    index_head_dim=8,
    index_n_heads=2,
    index_topk=4,
)
# any other int attribute named like a width (``*_dim``, ``*_size``, ``*_rank``) above 64 goes to 32
_WIDTH = re.compile(r"(_dim|_size|_rank|_channels|_hidden)$")
_KEEP = frozenset(
    {
        "vocab_size",
        "image_size",
        "patch_size",
        "num_channels",
        "max_position_embeddings",
        "chunk_size",
        "sliding_window_size",
        "window_size",
        "batch_size",
        "spatial_merge_size",
        "temporal_patch_size",
    }
)
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer")
_TOKEN_IDS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "sep_token_id",
    "cls_token_id",
    "mask_token_id",
    "unk_token_id",
)
_TINY_LEN, _TINY_BATCH = 8, 2
_RELOAD_TOL = 1e-12


def _transformers_root() -> str:
    import transformers

    return os.path.join(os.path.dirname(transformers.__file__), "models")


def _attention_call_kwargs(text: str) -> set[str]:
    """Keyword names in every ``attention_interface(...)`` call of a modeling file."""
    names: set[str] = set()
    for m in re.finditer(r"attention_interface\(", text):
        i = j = m.end()
        depth = 1
        while depth and j < len(text):
            depth += (text[j] == "(") - (text[j] == ")")
            j += 1
        names |= set(re.findall(r"(?<![\w.])(\w+)\s*=(?!=)", text[i : j - 1]))
    return names


def transformers_families() -> tuple[dict[str, list[str]], dict[str, str]]:
    """Group every transformers model type whose attention goes through ``AttentionInterface``.

    Returns:
        ``(families, skipped)``: family text -> sorted model types, and model type -> why it is not
        in any family (no modeling file, or attention not dispatched through the interface).
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    root = _transformers_root()
    families: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    by_file: dict[str, Optional[str]] = {}
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        mod = model_type_to_module_name(model_type)
        path = os.path.join(root, mod, f"modeling_{mod}.py")
        if not os.path.isfile(path):
            skipped[model_type] = "no modeling file"
            continue
        if path not in by_file:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            cfg_path = os.path.join(root, mod, f"configuration_{mod}.py")
            composite = False
            if os.path.isfile(cfg_path):
                with open(cfg_path, encoding="utf-8") as f:
                    composite = "sub_configs_defaults" in f.read()
            if "ALL_ATTENTION_FUNCTIONS.get_interface(" in text:
                extra = sorted(_attention_call_kwargs(text) - _COMMON_KWARGS)
                feats = [
                    ("+".join(extra) if extra else "plain"),
                    "layer_idx" if "self.layer_idx = layer_idx" in text else "no layer_idx",
                ]
                if _CROSS.search(text):
                    feats.append("cross-attention")
                if composite:
                    feats.append("composite config")
                by_file[path] = ", ".join(feats)
            elif composite and not _OWN_ATTENTION.search(text):
                by_file[path] = "composite of other model types (no attention class of its own)"
            else:
                by_file[path] = None
        family = by_file[path]
        if family is None:
            skipped[model_type] = "attention not dispatched through AttentionInterface"
        else:
            families.setdefault(family, []).append(model_type)
    return families, skipped


def _shrink(config: Any, depth: int = 0) -> Any:
    """Shrink a config in place to the tiny sizes of :data:`_SIZES` (and its sub-configs)."""
    values = dict(config.__dict__)
    old_layers = next((values[k] for k in _LAYER_COUNTS if isinstance(values.get(k), int)), None)
    for key, size in _SIZES.items():
        v = values.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            with contextlib.suppress(Exception):
                setattr(config, key, size)
    for key, v in values.items():
        if (
            _WIDTH.search(key)
            and key not in _KEEP
            and key not in _SIZES
            and isinstance(v, int)
            and not isinstance(v, bool)
            and v > 64
        ):
            with contextlib.suppress(Exception):
                setattr(config, key, 32)
        elif key == "conv_dim" and isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v):
            with contextlib.suppress(Exception):
                setattr(config, key, type(v)(min(x, 32) for x in v))
    if isinstance(values.get("kv_lora_rank"), int):  # multi-head latent attention: a KV head per query head
        with contextlib.suppress(Exception):
            config.num_key_value_heads = config.num_attention_heads
            config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    for key, size in (("n_group", 1), ("topk_group", 1), ("first_k_dense_replace", 1)):
        if isinstance(values.get(key), int):
            with contextlib.suppress(Exception):
                setattr(config, key, size)
    new_layers = next((getattr(config, k) for k in _LAYER_COUNTS if isinstance(values.get(k), int)), None)
    for key, v in values.items():  # per-layer lists (layer_types, ...) follow the new depth
        if (
            isinstance(v, (list, tuple))
            and old_layers
            and new_layers
            and len(v) == old_layers
            and old_layers != new_layers
            and not key.startswith("_")
        ):
            with contextlib.suppress(Exception):
                setattr(config, key, type(v)(v[:new_layers]))
    vocab = getattr(config, "vocab_size", None)
    for key in _TOKEN_IDS:
        v = values.get(key)
        if isinstance(v, int) and isinstance(vocab, int) and v >= vocab:
            with contextlib.suppress(Exception):
                setattr(config, key, min(_TOKEN_IDS.index(key), vocab - 1))
    for sub in getattr(config, "sub_configs", {}) or {}:
        child = getattr(config, sub, None)
        if child is not None and depth < 3 and hasattr(child, "__dict__"):
            _shrink(child, depth + 1)
    return config


def _config_values(config: Any, key: str) -> list[Any]:
    out = [getattr(config, key, None)]
    for sub in getattr(config, "sub_configs", {}) or {}:
        child = getattr(config, sub, None)
        if child is not None:
            out.append(getattr(child, key, None))
    return [v for v in out if isinstance(v, int) and not isinstance(v, bool)]


def _tiny_inputs(model: Any) -> dict[str, Any]:
    """Inputs for a tiny model: token ids (a right-padded batch), images, decoder ids, as it takes them."""

    config = model.config
    params = inspect.signature(model.forward).parameters
    g = torch.Generator().manual_seed(1)
    inputs: dict[str, Any] = {}
    main = getattr(model, "main_input_name", "input_ids")
    if "input_ids" in params and main in ("input_ids", "pixel_values"):
        vocab = min(_config_values(config, "vocab_size") or [99])
        inputs["input_ids"] = torch.randint(3, max(4, min(vocab, 99)), (_TINY_BATCH, _TINY_LEN), generator=g)
        if "attention_mask" in params:
            mask = torch.ones(_TINY_BATCH, _TINY_LEN, dtype=torch.long)
            mask[1, -2:] = 0  # right padding: no query row is ever fully masked
            inputs["attention_mask"] = mask
    if "pixel_values" in params and (main == "pixel_values" or hasattr(config, "vision_config")):
        vision = getattr(config, "vision_config", None) or config
        size = getattr(vision, "image_size", 32)
        size = size if isinstance(size, int) else 32
        channels = getattr(vision, "num_channels", 3)
        inputs["pixel_values"] = torch.randn(
            _TINY_BATCH, channels if isinstance(channels, int) else 3, size, size, generator=g, dtype=torch.float64
        )
    if main == "input_values" and "input_values" in params:
        inputs["input_values"] = torch.randn(_TINY_BATCH, 4000, generator=g, dtype=torch.float64)
    if main == "input_features" and "input_features" in params:
        bins = getattr(config, "num_mel_bins", None) or getattr(config, "feature_size", 80)
        frames = 2 * getattr(config, "max_source_positions", 16)
        inputs["input_features"] = torch.randn(_TINY_BATCH, bins, frames, generator=g, dtype=torch.float64)
    if main == "pixel_values_videos" and "pixel_values_videos" in params:
        vision = getattr(config, "vision_config", None) or config
        size = getattr(vision, "image_size", 32)
        size = size if isinstance(size, int) else 32
        inputs["pixel_values_videos"] = torch.randn(
            _TINY_BATCH, getattr(vision, "num_frames", 2), 3, size, size, generator=g, dtype=torch.float64
        )
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        inputs["decoder_input_ids"] = torch.randint(3, 50, (_TINY_BATCH, 5), generator=g)
    if not inputs or main not in inputs:
        raise _NotBuilt(f"needs `{main}` inputs (no generic tiny recipe)")
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs


class _NotBuilt(Exception):
    """The tiny model of a type cannot be built offline by the generic recipe."""


#: Auto classes a tiny model is built with, the first that knows the type (the base model first).
_AUTO_CLASSES = (
    "AutoModel",
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForImageTextToText",
    "AutoModelForSpeechSeq2Seq",
    "AutoModelForCTC",
    "AutoModelForImageClassification",
    "AutoModelForObjectDetection",
    "AutoModelForTextEncoding",
)


def _auto_class(model_type: str) -> Any:
    import transformers

    for name in _AUTO_CLASSES:
        auto = getattr(transformers, name)
        if model_type in auto._model_mapping._model_mapping:
            return auto
    return None


def build_tiny_transformers_model(model_type: str) -> tuple[Any, dict[str, Any]]:
    """A tiny random float64 model of ``model_type`` (the first auto class that has one) and inputs, offline.

    Raises:
        _NotBuilt: the generic recipe does not fit this type (the message says why).
    """
    from transformers import AutoConfig

    auto = _auto_class(model_type)
    if auto is None:
        raise _NotBuilt("no auto model class (a sub-config of another type)")
    try:
        config = _shrink(AutoConfig.for_model(model_type))
        config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
        with torch.device("meta"):
            meta = auto.from_config(config)
        n = sum(p.numel() for p in meta.parameters())
        del meta
    except Exception as e:  # the class defaults do not shrink (or need a download / a package)
        raise _NotBuilt(f"config/model: {type(e).__name__}: {e}") from e
    if n > MAX_PARAMS:
        raise _NotBuilt(f"the generic recipe leaves {n / 1e6:.1f}M parameters (sizes it does not know)")
    try:
        torch.manual_seed(0)
        model = auto.from_config(config, dtype=torch.float64).eval()
        inputs = _tiny_inputs(model)
        try:
            with torch.no_grad():
                model(**inputs)
        except Exception:
            if "pixel_values" not in inputs or "input_ids" not in inputs:
                raise
            del inputs["pixel_values"]  # an image-text model whose image tokens the generic ids lack: text only
            with torch.no_grad():
                model(**inputs)
            model._coverage_note = "; text inputs only (the generic token ids hold no image tokens)"
    except _NotBuilt:
        raise
    except Exception as e:
        raise _NotBuilt(f"stock forward: {type(e).__name__}: {e}") from e
    return model, inputs


def _run(model: Any, inputs: dict[str, Any]) -> list[torch.Tensor]:
    with torch.no_grad():
        return tensors(model(**inputs))


def check_transformers_model(
    model: Any, inputs: dict[str, Any], heads: Any = 1, reload: bool = True
) -> tuple[str, str]:
    """Classify one tiny model: (status, detail), the status "supported", "refused" or "failed".

    Args:
        model: a float64 transformers model in eval mode with its stock attention implementation.
        inputs: keyword inputs of its forward.
        heads: the Laplacian head setting to check.
        reload: also check ``save_pretrained`` + reload (see the module docstring).
    """

    import lapheads.transformers as lt
    from lapheads.errors import ConfigError

    stock = _run(model, inputs)
    step = "enable"
    try:
        lt.enable(model, heads)
        step = "fused forward"
        fused = _run(model, inputs)
        step = "eager twin"
        lt.enable(model, heads, eager=True)
        eager = _run(model, inputs)
        step = "k=0"
        lt.enable(model, 0)
        zero = _run(model, inputs)
    except ConfigError as e:
        return "refused", one_line(e)
    except Exception as e:
        return "failed", f"crash ({step}): {one_line(f'{type(e).__name__}: {e}')}"
    # float64 throughout: 1e-9; a model that keeps modules in float32 (routers, convolutions) rounds there
    tol = 1e-9 if all(t.dtype == torch.float64 for t in model.state_dict().values() if t.is_floating_point()) else 1e-5
    diff = max_diff(fused, eager)
    if not diff <= tol:
        return "failed", f"fused differs from the eager twin by {diff:.2e}"
    if max_diff(fused, stock) <= 1e-9:
        return "failed", "silently standard (Laplacian heads change nothing)"
    if not equal(zero, stock):
        return "failed", f"k=0 is not bit-identical to stock (max diff {max_diff(zero, stock):.2e})"
    if reload:
        verdict = _check_reload(model, inputs, heads, fused)
        if verdict:
            lt.enable(model, 0)
            stock_fails = _stock_reload_fails(model, inputs, stock)
            if stock_fails:  # an artefact of the generic tiny config, not of Laplacian heads
                return "supported", f"save + reload not checked: the stock tiny model does not reload: {stock_fails}"
            return "failed", verdict
    return "supported", CHECKED if reload else CHECKED.split("; save")[0]


def _stock_reload_fails(model: Any, inputs: dict[str, Any], stock: list[Any]) -> str:
    """Why the stock model (laplacian_heads=0 with a stock implementation) does not save and reload, or ''."""

    cls = type(model)
    model.config.laplacian_heads = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            impl = "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"
            model.set_attn_implementation(impl)
            model.save_pretrained(tmp)
            again = _run(
                cls.from_pretrained(
                    tmp, dtype=torch.float64, experts_implementation="eager", attn_implementation=impl
                ).eval(),
                inputs,
            )
        except Exception as e:
            return one_line(f"{type(e).__name__}: {e}", 120)
    return "" if max_diff(again, stock) <= _RELOAD_TOL else f"differs by {max_diff(again, stock):.1e}"


def _check_reload(model: Any, inputs: dict[str, Any], heads: Any, fused: list[Any]) -> str:
    """'' when save + reload keeps the Laplacian model (and a plain load never gives another one), else what failed."""

    import lapheads.transformers as lt

    cls = type(model)
    lt.enable(model, heads)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            model.save_pretrained(tmp)
            back = lt.from_pretrained(tmp, model_class=cls, dtype=torch.float64, experts_implementation="eager").eval()
            again = _run(back, inputs)
        except Exception as e:
            return f"save + lapheads.transformers.from_pretrained: {one_line(f'{type(e).__name__}: {e}')}"
        # 1e-12, not bit-identity: some stock models (CLIP) reload 1e-16 apart without lapheads too
        if not max_diff(again, fused) <= _RELOAD_TOL:
            return f"reloaded model differs (max diff {max_diff(again, fused):.2e})"
        try:
            plain = _run(cls.from_pretrained(tmp, dtype=torch.float64, experts_implementation="eager").eval(), inputs)
        except Exception:
            return ""  # refused at load or first forward: never silently standard
        if not max_diff(plain, fused) <= _RELOAD_TOL:
            return f"plain from_pretrained gives another model (max diff {max_diff(plain, fused):.2e})"
    return ""


@contextlib.contextmanager
def _quiet() -> Any:
    """transformers' warnings and logs off (their text would not be deterministic)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    root = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        logging.getLogger().setLevel(root)


def _candidates(members: list[str]) -> list[str]:
    """The members to try, preferred ones first, only those an auto class can build."""
    buildable = [m for m in members if _auto_class(m) is not None]
    first = [m for m in PREFERRED if m in buildable]
    return (first + [m for m in buildable if m not in first])[:MAX_TRIES]


def transformers_coverage(
    families: Optional[dict[str, list[str]]] = None,
    reload: bool = True,
    progress: Optional[Callable[[Row], None]] = None,
) -> list[Row]:
    """Build one tiny representative per attention family and classify it (see the module docstring).

    Args:
        families: family -> model types; default :func:`transformers_families`.
        reload: include the save + reload check.
        progress: called with each finished row.

    Returns:
        One :class:`Row` per family, sorted by family text.
    """
    families = families if families is not None else transformers_families()[0]
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for family in sorted(families):
            t0 = time.perf_counter()
            members = sorted(families[family])
            status, detail, rep, built, reasons = "", "", "", "", []
            for candidate in _candidates(members):
                with _quiet():
                    try:
                        model, inputs = build_tiny_transformers_model(candidate)
                    except _NotBuilt as e:
                        reasons.append(f"{candidate}: {one_line(e, 120)}")
                        continue
                    rep, built = candidate, f"{_auto_class(candidate).__name__}, float64"
                    status, detail = check_transformers_model(model, inputs, reload=reload)
                    if status == "supported":
                        detail += getattr(model, "_coverage_note", "")
                    break
            if not rep:
                status, detail = "not built", "; ".join(reasons) or "no member has an auto model class"
            row = Row(family, "", rep, built, members, status, detail, time.perf_counter() - t0)
            rows.append(row)
            if progress:
                progress(row)
    finally:
        torch.set_num_threads(threads)
    return rows


#: the detail of a supported row
CHECKED = (
    "fused = eager twin (I - P), differs from stock; k = 0 bit-identical; "
    "save + reload keeps it (plain from_pretrained too, or refuses)"
)

INTRO = """
Generated by `python -m tools.coverage transformers --write docs/coverage-transformers.md`
(`tools/coverage/transformers_table.py`); `tests/test_transformers_coverage.py` regenerates it
and fails when this file differs. Every model type of transformers' auto config mapping whose
attention goes through `AttentionInterface` is grouped into an attention family (the keyword
arguments its attention call carries, `layer_idx`, cross-attention, composite config); one tiny
random float64 representative per family is built offline and checked: 1 Laplacian head per
layer on the fused implementation equals the eager twin (the explicit `I - P` operator), differs
from the stock model, `k = 0` is bit-identical to stock, and save + reload keeps the Laplacian
model (a plain `from_pretrained` either gives it too or refuses). **refused** quotes the
`ConfigError`; **not built** says why the generic tiny recipe did not fit; **failed** would be a
crash or a silently standard model (the test accepts no failed row).
"""


def transformers_markdown(rows: Sequence[Row], skipped: Optional[dict[str, str]] = None) -> str:
    """The transformers table as Markdown (:func:`tools.coverage.table.markdown`), with the versions and skips."""
    import transformers

    extra = ""
    if skipped:
        by_reason: dict[str, list[str]] = {}
        for model_type, why in sorted(skipped.items()):
            by_reason.setdefault(why, []).append(model_type)
        extra = "## Model types not in the table\n\n" + "\n".join(
            f"- {why} ({len(types)}): {', '.join(types)}" for why, types in sorted(by_reason.items())
        )
    versions = f"transformers {transformers.__version__}, torch {torch.__version__.split('+')[0]}."
    return markdown(
        "Laplacian heads in Hugging Face transformers: coverage", INTRO + "\n" + versions + "\n", rows, extra
    )
