"""Serving Laplacian models through vLLM's Transformers backend (``pip install "lapheads[serve]"``; docs/serving.md).

vLLM loads :func:`register_vllm` as a general plugin (the ``vllm.general_plugins`` entry point of this
package) in each of its processes; it is never run otherwise. The head arithmetic on a tensor-parallel
rank is :mod:`lapheads.serve.rank_heads`, the refusals :mod:`lapheads.serve.checks`, both plain torch;
:mod:`lapheads.serve.vllm_plugin` is the glue to vLLM and :mod:`lapheads.serve.sglang` the refusal for SGLang.
"""

from __future__ import annotations


def register_vllm() -> None:
    """vLLM's plugin hook (imported by vLLM only: importing this package imports neither vLLM nor transformers)."""
    from .vllm_plugin import register

    register()


def register_sglang() -> None:
    """SGLang's plugin hook: it refuses Laplacian models (imported by SGLang only)."""
    from .sglang import register

    register()


__all__ = ["register_vllm", "register_sglang"]
