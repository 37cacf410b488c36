"""`lapheads lm-eval`: lm-evaluation-harness's own CLI (HFLM, ``--model hf``) on a Laplacian run."""

from __future__ import annotations

import json

import pytest
import torch

from lapheads.cli import main as cli
from lapheads.recipes import lm as R

from _lm_helpers import local_mc_task, tiny_lm_run

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.xdist_group("lm_eval_cli")  # one tiny LM run shared by the module, on one worker


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_lm_run(tmp_path_factory.mktemp("lmevalcli"), "2", 4)


def _hflm(run, **kw):
    from lm_eval.models.huggingface import HFLM

    import lapheads.transformers  # noqa: F401 - what `lapheads lm-eval` imports first

    return HFLM(pretrained=str(run / "final" / "hf"), device="cpu", batch_size=2, dtype="float32", **kw)


def test_hflm_loglikelihoods_equal_the_lapheads_wrapper(run):
    """HFLM on the export scores (context, continuation) pairs exactly like ``lapheads eval lm``'s wrapper."""
    from lm_eval.api.instance import Instance

    from lapheads.lm.evaluate import make_lm_eval_model

    model, tok = R.load_model(run)
    wrapper = make_lm_eval_model(model, tok, batch_size=2)
    hflm = _hflm(run)
    assert hflm.model.config.laplacian_heads == 2
    reqs = [Instance("loglikelihood", {}, ("The list", " type"), 0),
            Instance("loglikelihood", {}, ("A", " dict is a mapping"), 1),
            Instance("loglikelihood", {}, ("", "Hello world"), 2)]
    want = wrapper.loglikelihood(reqs, disable_tqdm=True)
    got = hflm.loglikelihood(reqs, disable_tqdm=True)
    for (a, ga), (b, gb) in zip(want, got):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-6) and ga == gb  # float32 sums of ~50 nats


def test_lm_eval_cli_bad_flag_is_one_line(capsys):
    assert cli(["lm-eval", "run", "--no_such_flag", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lapheads lm-eval" in err[0] and "--no_such_flag" in err[0]


@pytest.mark.slow  # lm-eval indexes its ~10k built-in task files (~1 min on 2 cores)
def test_lapheads_lm_eval_runs_lm_evals_cli_on_a_laplacian_export(run, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = local_mc_task(tmp_path, "lapheads_cli_tiny_mc")
    out = tmp_path / "out"
    assert cli(["lm-eval", "--model", "hf", "--model_args", f"pretrained={run / 'final' / 'hf'},dtype=float32",
                "--tasks", "lapheads_cli_tiny_mc", "--include_path", str(tasks), "--device", "cpu",
                "--batch_size", "2", "--output_path", str(out)]) == 0
    assert "lapheads_cli_tiny_mc" in capsys.readouterr().out  # lm-eval's own results table
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1
    res = json.loads(files[0].read_text())
    assert 0.0 <= res["results"]["lapheads_cli_tiny_mc"]["acc,none"] <= 1.0
    assert res["n-samples"]["lapheads_cli_tiny_mc"]["effective"] == 3
    # the numbers are those of the Laplacian model: same accuracy as the in-process wrapper gives
    from lapheads.lm.evaluate import run_lm_eval
    model, tok = R.load_model(run)
    mine = run_lm_eval(model, tok, ["lapheads_cli_tiny_mc"], include_path=str(tasks))
    assert mine["results"]["lapheads_cli_tiny_mc"]["acc,none"] == res["results"]["lapheads_cli_tiny_mc"]["acc,none"]


def test_eval_lm_bootstrap_iters_is_a_flag_with_lm_evals_default(run, tmp_path, monkeypatch):
    """``lapheads eval lm`` used to hard-code ``bootstrap_iters=0`` (no standard errors)."""
    import inspect

    import lm_eval

    from lapheads.lm import evaluate as E

    seen = []

    def fake_simple_evaluate(**kw):
        seen.append(kw["bootstrap_iters"])
        return {"results": {"t": {"acc,none": 1.0, "acc_stderr,none": 0.0}}, "n-samples": {}, "versions": {}}

    default = inspect.signature(lm_eval.simple_evaluate).parameters["bootstrap_iters"].default
    monkeypatch.setattr(lm_eval, "simple_evaluate", fake_simple_evaluate)
    monkeypatch.setattr(E, "lm_eval_task_manager", lambda *a, **k: object())  # no task index needed
    assert E.LM_EVAL_BOOTSTRAP_ITERS == default
    out = tmp_path / "e.json"
    assert cli(["eval", "lm", "--run", str(run), "--lm-eval", "t", "--out", str(out)]) == 0
    assert cli(["eval", "lm", "--run", str(run), "--lm-eval", "t", "--out", str(out), "--bootstrap-iters", "0"]) == 0
    assert seen == [default, 0]


def test_eval_lm_rolling_loglikelihood_has_one_bos(run):
    """``lapheads eval lm --lm-eval`` scores a document after exactly one BOS (perplexity tasks)."""
    from lm_eval.api.instance import Instance

    from lapheads.lm.evaluate import make_lm_eval_model

    model, tok = R.load_model(run)
    text = "The list type is a mutable sequence. " * 4  # longer than the 64-token context: two windows
    ids = tok.encode(text, add_special_tokens=False)
    assert 64 < len(ids) <= 128
    (got,) = make_lm_eval_model(model, tok).loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    want = 0.0
    with torch.no_grad():  # window 1: BOS + ids[:63] predicts ids[:64]; window 2: the last 64 inputs predict the rest
        seq = [tok.bos_token_id] + ids
        lp = torch.log_softmax(model(torch.tensor([seq[:64]]), use_cache=False).logits[0].float(), -1)
        want += sum(float(lp[j, seq[j + 1]]) for j in range(64))
        rest = len(ids) - 64
        ctx = seq[len(seq) - 1 - 64:len(seq) - 1]
        lp = torch.log_softmax(model(torch.tensor([ctx]), use_cache=False).logits[0].float(), -1)
        want += sum(float(lp[j, seq[len(seq) - 64 + j]]) for j in range(64 - rest, 64))
    assert got == pytest.approx(want, rel=1e-6, abs=1e-5)
