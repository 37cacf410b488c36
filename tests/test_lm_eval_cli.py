"""`lapheads lm-eval`: lm-evaluation-harness's own CLI (HFLM, ``--model hf``) on a Laplacian run."""

from __future__ import annotations

import json

import pytest
import torch
from _lm_helpers import greedy_by_recompute, local_mc_task, offline, tiny_lm_run

from lapheads.cli import main as cli
from lapheads.recipes import lm as R

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.xdist_group("lm_eval_cli")  # one tiny LM run shared by the module, on one worker


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_lm_run(tmp_path_factory.mktemp("lmevalcli"), "2", 4)


def _hflm(run, model="hf"):
    """lm-eval's ``--model hf`` (HFLM) or ``--model lapheads`` (LapheadsHFLM), built by path from the
    registry, with the Laplacian heads registered as ``lapheads lm-eval`` registers them."""
    from lm_eval.api.registry import get_model

    import lapheads.lm.hflm  # noqa: F401 - registers --model lapheads (and imports lapheads.transformers)

    return get_model(model)(pretrained=str(run / "final" / "hf"), device="cpu", batch_size=2, dtype="float32")


def _rolling_ll(model, tokens, prefix, L):
    """lm-eval's rolling log-likelihood of ``tokens`` (context length ``L``) written out: one forward
    pass over ``prefix`` + the first tokens predicts the first min(L, n) tokens; each later window
    of L inputs ends just before the last of the (up to L) new tokens it predicts."""
    seq = [prefix] + list(tokens)
    total, done = 0.0, 0
    with torch.no_grad():
        while done < len(tokens):
            end = done + min(L, len(tokens) - done)  # this window predicts seq[done + 1 .. end]
            start = max(0, end - L)
            lp = torch.log_softmax(model(torch.tensor([seq[start:end]]), use_cache=False).logits[0].float(), -1)
            total += sum(float(lp[e - 1 - start, seq[e]]) for e in range(done + 1, end + 1))
            done = end
    return total


def test_hflm_scores_after_exactly_one_bos_in_every_request_type(run):
    """HFLM on the export: loglikelihood and generate_until see one BOS; rolling log-likelihoods
    (perplexity tasks) see one BOS with ``--model lapheads`` and two with lm-eval's plain ``--model hf``."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tok = R.load_model(run)
    bos, L = tok.bos_token_id, model.config.max_position_embeddings
    hf, lap = _hflm(run, "hf"), _hflm(run, "lapheads")
    assert type(hf) is HFLM and isinstance(lap, HFLM) and lap.model.config.laplacian_heads == 2
    # loglikelihood (also an empty context, where lm-eval puts its prefix token before the continuation)
    pairs = [("The list", " type"), ("A", " dict is a mapping"), ("", "Hello world")]
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    for (ctx, cont), (a, _), (b, _) in zip(
        pairs, hf.loglikelihood(reqs, disable_tqdm=True), lap.loglikelihood(reqs, disable_tqdm=True)
    ):
        body = tok.encode(ctx + cont, add_special_tokens=False)
        n_ctx = len(tok.encode(ctx, add_special_tokens=False))
        want = _rolling_ll(model, body, bos, L) - _rolling_ll(model, body[:n_ctx], bos, L)
        assert a == pytest.approx(want, abs=1e-5) and b == pytest.approx(want, abs=1e-5)
    # loglikelihood_rolling, one document longer than the 64-token context (two windows) and a short one
    docs = ["The list type is a mutable sequence. " * 4, "None is a singleton."]
    assert len(tok.encode(docs[0], add_special_tokens=False)) > L
    reqs = [Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(docs)]
    got_lap = lap.loglikelihood_rolling(reqs, disable_tqdm=True)
    got_hf = hf.loglikelihood_rolling(reqs, disable_tqdm=True)
    for d, a, b in zip(docs, got_lap, got_hf):  # float32 sums of up to ~430 nats: 1e-5 or 0.1 ppm
        ids = tok.encode(d, add_special_tokens=False)
        assert a == pytest.approx(_rolling_ll(model, ids, bos, L), rel=1e-7, abs=1e-5)
        # lm-eval 0.4.13's HFLM scores BOS after BOS first; if this fails, lm-eval has changed its
        # rolling encoding and LapheadsHFLM's override (lapheads.lm.hflm) may no longer be needed
        assert b == pytest.approx(_rolling_ll(model, [bos] + ids, bos, L), rel=1e-7, abs=1e-5) and b < a - 1.0
    # generate_until: the model is given BOS + the context (left-padded in a batch of unequal lengths)
    seen = []
    real = lap._model_generate
    lap._model_generate = lambda context, **kw: (seen.extend(context.tolist()), real(context=context, **kw))[1]
    ctxs = ["The list", "A dict is a mapping from"]
    out = lap.generate_until(
        [Instance("generate_until", {}, (c, {"until": ["\n\n"], "max_gen_toks": 6}), i) for i, c in enumerate(ctxs)],
        disable_tqdm=True,
    )
    for c, text in zip(ctxs, out):
        ids = [bos] + tok.encode(c, add_special_tokens=False)
        assert any(row[len(row) - len(ids) :] == ids and bos not in row[: len(row) - len(ids)] for row in seen)
        new = greedy_by_recompute(model, torch.tensor([ids]), 6)[0, len(ids) :].tolist()
        stop = [j for j, t in enumerate(new) if t in (bos, tok.eos_token_id)]  # generation_config's stop ids
        assert text == tok.decode(new[: stop[0] if stop else None], skip_special_tokens=True).split("\n\n")[0]


def test_lapheads_lm_eval_indexes_the_chat_tasks_before_include_path(tmp_path, monkeypatch):
    """``lapheads lm-eval`` puts lapheads.lm.tasks first in lm-eval's include path (a list: lm-eval's
    TaskManager takes several directories), so ``--tasks lapheads_chat_mmlu`` needs no flag."""
    from lm_eval._cli.harness import HarnessCLI

    from lapheads.lm.tasks import TASKS_DIR

    seen = []
    monkeypatch.setattr(HarnessCLI, "execute", lambda self, args: seen.append(args.include_path))
    assert cli(["lm-eval", "ls", "tasks"]) == 0
    assert cli(["lm-eval", "--model", "hf", "--tasks", "x", "--include_path", str(tmp_path)]) == 0
    assert seen == [[str(TASKS_DIR)], [str(TASKS_DIR), str(tmp_path)]]


def test_lm_eval_cli_bad_flag_is_one_line(capsys):
    assert cli(["lm-eval", "run", "--no_such_flag", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lapheads lm-eval" in err[0] and "--no_such_flag" in err[0]


@pytest.mark.slow  # lm-eval indexes its ~10k built-in task files (~1 min on 2 cores)
def test_lapheads_lm_eval_runs_lm_evals_cli_on_a_laplacian_export(run, tmp_path, monkeypatch, capsys):
    offline(monkeypatch, tmp_path / "hf_datasets")  # `lapheads lm-eval` leaves that to the user, as lm-eval does
    tasks = local_mc_task(tmp_path, "lapheads_cli_tiny_mc")
    out = tmp_path / "out"
    assert (
        cli(
            [
                "lm-eval",
                "--model",
                "lapheads",
                "--model_args",
                f"pretrained={run / 'final' / 'hf'},dtype=float32",
                "--tasks",
                "lapheads_cli_tiny_mc",
                "--include_path",
                str(tasks),
                "--device",
                "cpu",
                "--batch_size",
                "2",
                "--output_path",
                str(out),
            ]
        )
        == 0
    )
    assert "lapheads_cli_tiny_mc" in capsys.readouterr().out  # lm-eval's own results table
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1
    res = json.loads(files[0].read_text())
    assert 0.0 <= res["results"]["lapheads_cli_tiny_mc"]["acc,none"] <= 1.0
    assert res["n-samples"]["lapheads_cli_tiny_mc"]["effective"] == 3
    # the numbers are those of the Laplacian model: same accuracy as `lapheads eval lm` gives
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
        [Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True
    )
    assert got == pytest.approx(_rolling_ll(model, ids, tok.bos_token_id, 64), rel=1e-6, abs=1e-5)
