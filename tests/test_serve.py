"""lapheads.serve without a serving engine: the head arithmetic of a tensor-parallel rank against explicit
attention, the refusals, the plugin's entry points, and serve_check's reference steps.

The engines themselves (vLLM's LLM) are exercised by benchmarks/serve_check.py (docs/serving.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from lapheads import ConfigError, HeadMix, LaplacianHeads, LayerHeads
from lapheads.serve import checks
from lapheads.serve.rank_heads import apply_rank_heads, check_tensor_parallel, rank_selection

ROOT = Path(__file__).resolve().parents[1]


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``P V`` per head for sequences packed in one row (causal within each), written out: ``(T, H, D)``."""
    h, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    k = k[0].repeat_interleave(h // hkv, dim=0)  # (H, T, D): query head j reads KV head j // (H / H_kv)
    v = v[0].repeat_interleave(h // hkv, dim=0)
    out, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        scores = q[0, :, s] @ k[:, s].transpose(-1, -2) / d**0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append(torch.softmax(scores.double(), dim=-1).to(q.dtype) @ v[:, s])
        start += n
    return torch.cat(out, dim=1).transpose(0, 1)  # (T, H, D)


def expected_heads(q, k, v, lengths, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a_h V + b_h P V`` for every query head, from the explicit attention: ``(T, H, D)``."""
    h = q.shape[1]
    pv = explicit_attention(q, k, v, lengths)
    v_self = v[0].repeat_interleave(h // k.shape[1], dim=0).transpose(0, 1)  # (T, H, D)
    return a.view(1, h, 1) * v_self + b.view(1, h, 1) * pv


def rank_inputs(q, k, v, tp: int, rank: int):
    """What a vLLM rank holds: its query heads and the KV heads they read (one replicated head when tp > H_kv)."""
    h, hkv = q.shape[1], k.shape[1]
    qs = slice(rank * h // tp, (rank + 1) * h // tp)
    ks = (
        slice(rank * hkv // tp, (rank + 1) * hkv // tp)
        if hkv >= tp
        else slice(rank // (tp // hkv), rank // (tp // hkv) + 1)
    )
    return q[:, qs], k[:, ks], v[:, ks], qs


def coefficients(selection: LayerHeads) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.tensor([selection.coef[0] if f else 0.0 for f in selection.flags], dtype=torch.float64)
    b = torch.tensor([selection.coef[1] if f else 1.0 for f in selection.flags], dtype=torch.float64)
    return a, b


@pytest.mark.parametrize("n_kv", [8, 2, 1])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("spec", [3, "all", [[1, 2, 6]], "mix(0.5,-1):5", "identity:2", "negated:1", "learn"])
def test_rank_heads_match_explicit_attention(spec, tp, n_kv):
    torch.manual_seed(0)
    h, d, lengths = 8, 16, [5, 1, 7]  # a prefill, a decoded token, another prefill, packed
    t = sum(lengths)
    q, k, v = (torch.randn(1, n, t, d, dtype=torch.float64) for n in (h, n_kv, n_kv))
    if spec == "learn":
        a, b = torch.randn(h, dtype=torch.float64), torch.randn(h, dtype=torch.float64)
    else:
        selection = LaplacianHeads(spec).resolve(1, h)[0]
        a, b = coefficients(selection)
    want = expected_heads(q, k, v, lengths, a, b)
    for rank in range(tp):
        ql, kl, vl, qs = rank_inputs(q, k, v, tp, rank)
        out = explicit_attention(ql, kl, vl, lengths).reshape(t, -1)  # the engine's (T, H_rank * D)
        heads = HeadMix(a[qs], b[qs]) if spec == "learn" else rank_selection(selection, n_kv, tp, rank)
        got = apply_rank_heads(out, vl, heads).view(t, -1, d)
        torch.testing.assert_close(got, want[:, qs], rtol=1e-12, atol=1e-12)


def test_a_rank_without_laplacian_heads_keeps_the_engines_output():
    out, value = torch.randn(4, 2 * 8), torch.randn(1, 1, 4, 8)
    assert apply_rank_heads(out, value, rank_selection(LayerHeads((False, False, True, True)), 1, 2, 0)) is out
    assert rank_selection(LayerHeads((False, False, True, True)), 1, 2, 1).flags == (True, True)


def test_apply_rank_heads_refuses_shapes_that_do_not_fit():
    with pytest.raises(ConfigError, match="does not fit"):
        apply_rank_heads(torch.randn(4, 3 * 8), torch.randn(1, 1, 4, 8), LayerHeads((True, False)))
    with pytest.raises(ConfigError, match="expected"):
        apply_rank_heads(torch.randn(4, 16), torch.randn(4, 8), LayerHeads((True, False)))


@pytest.mark.parametrize(
    ("h", "hkv", "tp", "match"),
    [(8, 2, 3, "unevenly"), (12, 4, 6, "neither divides nor is a multiple"), (8, 3, 1, "multiple of the KV heads")],
)
def test_tensor_parallel_splits_that_cannot_be_served_are_refused(h, hkv, tp, match):
    with pytest.raises(ConfigError, match=match) as e:
        check_tensor_parallel(h, hkv, tp)
    assert "\n" not in str(e.value) and f"tensor_parallel_size={tp}" in str(e.value)


def test_a_rank_outside_the_group_is_refused():
    with pytest.raises(ConfigError, match="rank 2 is outside 0..1"):
        rank_selection(LayerHeads((True, False)), 2, 2, 2)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.32.0+cpu", "0.32.1.dev3+gabc"])
def test_tested_vllm_releases_pass(version):
    checks.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "0.33.0rc1", "1.0.0", "not-a-version"])
def test_other_vllm_releases_are_refused_in_one_line(version):
    with pytest.raises(ConfigError, match=rf"vllm=={version} is outside") as e:
        checks.check_vllm_version(version)
    assert "\n" not in str(e.value) and "VLLM_PLUGINS" in str(e.value)


def _heads(spec=2) -> checks.ServedHeads:
    return checks.ServedHeads((LayerHeads((False, True)),), False, spec)


class _Impl:  # vLLM passes an enum member, whose .value is the name
    value = "auto"


@pytest.mark.parametrize("requested", ["auto", "transformers", _Impl()])
def test_model_impl_auto_becomes_the_transformers_backend(requested):
    assert checks.model_impl(requested, _heads()) == "transformers"


@pytest.mark.parametrize("requested", ["vllm", "terratorch"])
def test_model_impl_other_than_transformers_is_refused(requested):
    with pytest.raises(ConfigError, match=rf"model_impl='{requested}' would serve .* use --model-impl transformers"):
        checks.model_impl(requested, _heads())


def test_only_the_served_transformers_backend_classes_pass():
    checks.check_served_class("TransformersForCausalLM", "TransformersForCausalLM", _heads())
    checks.check_served_class("TransformersMoEForCausalLM", "TransformersMoEForCausalLM", _heads())
    with pytest.raises(ConfigError, match="resolved the model .* to LlamaForCausalLM, not its Transformers backend"):
        checks.check_served_class("LlamaForCausalLM", "TransformersForCausalLM", _heads())
    with pytest.raises(ConfigError, match="would be TransformersMultiModalForCausalLM"):
        checks.check_served_class(
            "TransformersMultiModalForCausalLM", "TransformersMultiModalForCausalLM", _heads("learn")
        )


@pytest.mark.parametrize("kwargs", [{"decode_context": 2}, {"prefill_context": 4}])
def test_context_parallelism_is_refused(kwargs):
    sizes = {"tensor": 2, "pipeline": 2, "decode_context": 1, "prefill_context": 1} | kwargs
    with pytest.raises(ConfigError, match="context parallelism"):
        checks.check_parallel(**sizes)
    checks.check_parallel(2, 2, 1, 1)


def test_latent_attention_is_refused():
    checks.check_attention_kind("vllm")
    with pytest.raises(ConfigError, match="'vllm_mla'.*identity term cannot be formed"):
        checks.check_attention_kind("vllm_mla")


def test_served_heads_reads_the_config_through_lapheads_transformers():
    from transformers import LlamaConfig

    import lapheads.transformers as lt

    def config(spec):
        c = LlamaConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
        return lt.enable(c, spec)

    assert checks.served_heads(LlamaConfig()) is None
    assert checks.served_heads(config(0)) is None
    heads = checks.served_heads(config([[0], [], [1, 3]]))
    assert heads is not None and not heads.learnable
    assert [s.indices for s in heads.selections] == [(0,), (), (1, 3)]
    learn = checks.served_heads(config("learn:standard"))  # no head starts Laplacian, the mixing still matters
    assert learn is not None and learn.learnable and not any(s.any for s in learn.selections)
    bad = config(1)
    bad.laplacian_heads = 9
    with pytest.raises(ConfigError):
        checks.served_heads(bad)


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_engines_plugin_entry_points_are_declared_and_resolve():
    import lapheads.serve

    points = _pyproject()["project"]["entry-points"]
    assert points["vllm.general_plugins"] == {"lapheads": "lapheads.serve:register_vllm"}
    assert points["sglang.srt.plugins"] == {"lapheads": "lapheads.serve:register_sglang"}
    assert callable(lapheads.serve.register_vllm) and callable(lapheads.serve.register_sglang)


def test_the_serve_extra_pins_the_tested_vllm_releases():
    serve = _pyproject()["project"]["optional-dependencies"]["serve"]
    assert f"vllm{checks.TESTED_VLLM}" in serve


def test_importing_lapheads_serve_loads_no_engine_and_the_hook_needs_vllm():
    # The entry point's module is imported by the engine only; the hook itself starts by importing vLLM.
    code = (
        "import sys, lapheads.serve\n"
        "assert not {'vllm', 'sglang', 'transformers'} & set(sys.modules), sorted(sys.modules)\n"
        "try:\n    lapheads.serve.register_vllm()\nexcept ModuleNotFoundError as e:\n    print(e.name)\n"
        "else:\n    print('registered')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    try:
        import vllm  # noqa: F401
    except ModuleNotFoundError:
        assert out == "vllm"
    else:
        assert out == "registered"


def test_the_sglang_hook_refuses_a_laplacian_config_and_passes_a_standard_one():
    import types

    from transformers import LlamaConfig

    import lapheads.transformers as lt
    from lapheads.serve.sglang import refuse_laplacian

    standard = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
    holder = types.SimpleNamespace(model_path="m", hf_config=standard, hf_text_config=standard)
    assert refuse_laplacian(None, holder) is None
    laplacian = lt.enable(LlamaConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64), 1)
    holder = types.SimpleNamespace(model_path="m", hf_config=laplacian, hf_text_config=laplacian)
    with pytest.raises(ConfigError, match="m: laplacian_heads=1 is not served by SGLang") as e:
        refuse_laplacian(None, holder)
    assert "\n" not in str(e.value)


def test_serve_check_reference_steps_run_without_vllm(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("serve_check", None)
    import serve_check

    out = tmp_path / "rows.json"
    code = serve_check.main(["--device", "cpu", "--reference-only", "--tokens", "6", "--json", str(out)])
    assert code == 0, capsys.readouterr().out
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [r["heads"] for r in rows] == ["0", *serve_check.DEFAULT_HEADS]
    # every built Laplacian model generates something else than its weights as a standard model
    assert all(r["differs_from_standard"] for r in rows[1:])
