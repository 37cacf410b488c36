"""`lapheads sample` and `lapheads eval lm` (chat tasks and other lm-evaluation-harness tasks, on local data)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from _lm_helpers import local_mc_task, offline, tiny_lm_run

from lapheads.cli import main as cli
from lapheads.errors import ConfigError
from lapheads.lm.evaluate import make_lm_eval_model, parse_tasks
from lapheads.recipes import lm as R

pytestmark = pytest.mark.xdist_group("lm_eval")  # one tiny LM run shared by the module, on one worker


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_lm_run(tmp_path_factory.mktemp("lmeval"), "all", 6)


def test_sample_cli(run, capsys):
    assert cli(["sample", "--run", str(run), "--prompt", "The list", "--max-new-tokens", "5"]) == 0
    greedy = capsys.readouterr().out
    assert greedy.startswith("The list")
    assert cli(["sample", "--run", str(run), "--prompt", "The list", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out == greedy  # greedy is deterministic
    assert (
        cli(
            [
                "sample",
                "--run",
                str(run),
                "--prompt",
                "A",
                "--max-new-tokens",
                "4",
                "--temperature",
                "0.9",
                "--top-k",
                "20",
                "--num-samples",
                "2",
                "--chat",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.count("--- sample") == 2
    assert cli(["sample", "--run", str(run), "--prompt", "A", "--temperature", "-1"]) == 2


def test_kv_cached_sampling_matches_full_recompute(run):
    model, tok = R.load_model(run)
    ids = tok("The list type")["input_ids"]
    x = torch.tensor([ids])
    with torch.no_grad():
        gen = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tok.pad_token_id,
        )[0].tolist()
        seq = list(ids)
        for _ in range(6):
            seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    assert gen == seq


def test_eval_lm_model_is_lm_evals_hflm_and_scores_after_one_bos(run):
    """``eval lm --lm-eval`` evaluates through lm-eval's HFLM (the wrapper it replaced is gone); each
    (context, continuation) is scored after exactly one BOS, batched with right padding."""
    pytest.importorskip("accelerate")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tok = R.load_model(run)
    lm = make_lm_eval_model(model, tok, batch_size=2)
    assert isinstance(lm, HFLM) and lm.max_length == model.config.max_position_embeddings
    pairs = [("The list", " type"), ("A", " dict is a mapping"), ("", "Hello world")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    for (ctx, cont), (ll, _) in zip(pairs, got):
        body = tok.encode(ctx + cont, add_special_tokens=False)
        n_ctx = len(tok.encode(ctx, add_special_tokens=False))
        seq = [tok.bos_token_id] + body  # one BOS, then the text
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([seq]), use_cache=False).logits[0].float(), -1)
        want = sum(float(lp[j, seq[j + 1]]) for j in range(n_ctx, len(body)))
        assert ll == pytest.approx(want, abs=1e-5)


@pytest.mark.slow  # a whole lm-eval evaluation of a local task
def test_eval_lm_cli_lm_eval_local_task_offline(run, tmp_path, monkeypatch):
    offline(monkeypatch, tmp_path / "hf_datasets")
    tasks = local_mc_task(tmp_path, "lapheads_tiny_mc")
    assert cli(["eval", "lm", "--run", str(run), "--lm-eval", "lapheads_tiny_mc", "--lm-eval-include", str(tasks)]) == 0
    res = json.loads((run / "eval.json").read_text())
    r = res["lm_eval"]["results"]["lapheads_tiny_mc"]
    assert 0.0 <= r["acc,none"] <= 1.0 and res["lm_eval"]["n-samples"]["lapheads_tiny_mc"]["effective"] == 3
    # bootstrap_iters is lm-eval's default (> 0), so the accuracy carries its standard error
    acc = r["acc,none"]
    assert r["acc_stderr,none"] == pytest.approx((acc * (1 - acc) / 2) ** 0.5)  # sample std / sqrt(n), n = 3
    assert res["laplacian_heads"] == "all"
    # an unknown task name (which needs lm-eval's whole index, ~8 s): test_bad_inputs.py's
    # test_eval_lm_checks_lm_eval_task_names_before_loading_the_model


def test_offline_also_switches_the_already_imported_hub_and_datasets(monkeypatch):
    """``lapheads eval lm`` puts the hub offline. Setting HF_HUB_OFFLINE in the environment came too
    late for huggingface_hub, which reads it when imported (transformers imports it first): it stayed
    online while ``datasets`` (imported later) went offline. A user's explicit ``...=0`` still wins."""
    import datasets.config as ds
    import huggingface_hub
    import huggingface_hub.constants as hub

    from lapheads.lm import evaluate as E

    names = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    for k in names:
        monkeypatch.setenv(k, "x")  # recorded, so the teardown removes what _offline() sets
        monkeypatch.delenv(k)
    for mod, attr in ((hub, "HF_HUB_OFFLINE"), (ds, "HF_HUB_OFFLINE"), (ds, "HF_DATASETS_OFFLINE")):
        monkeypatch.setattr(mod, attr, False)  # online, as after an import without the variables
    E._offline()
    assert huggingface_hub.is_offline_mode() and ds.HF_HUB_OFFLINE and ds.HF_DATASETS_OFFLINE
    for k in names:
        monkeypatch.setenv(k, "0")
    E._offline()
    assert not huggingface_hub.is_offline_mode() and not ds.HF_HUB_OFFLINE


def test_local_tasks_are_indexed_without_lm_evals_built_ins(tmp_path, monkeypatch):
    """Tasks that are all plain tasks of lapheads' chat tasks or --lm-eval-include use those directories'
    index alone (the built-in index costs seconds); a group, a tag, a built-in or unknown name takes
    the full one. The include directory comes after the chat tasks' (a later one overrides a name)."""
    import lm_eval.tasks

    from lapheads.lm import evaluate as E
    from lapheads.lm.tasks import TASKS_DIR

    monkeypatch.setattr(E, "_offline", lambda: None)
    built = []
    local_index = {"my_task": "task", "my_group": "group", "lapheads_chat_mmlu": "task"}

    class FakeTaskManager:
        def __init__(self, include_path=None, include_defaults=True):
            built.append((include_path, include_defaults))
            index = dict(local_index, **({"arc_easy": "task"} if include_defaults else {}))
            self.all_tasks = sorted(index)
            self.all_subtasks = sorted(k for k, v in index.items() if v == "task")

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", FakeTaskManager)
    inc = str(tmp_path)
    paths = [str(TASKS_DIR), inc]
    assert "my_task" in E.lm_eval_task_manager(["my_task"], inc).all_tasks and built == [(paths, False)]
    for tasks in (["my_task", "arc_easy"], ["my_group"]):
        built.clear()
        assert "arc_easy" in E.lm_eval_task_manager(tasks, inc).all_tasks and built == [(paths, False), (paths, True)]
    built.clear()
    with pytest.raises(ConfigError, match="no_such_task"):
        E.lm_eval_task_manager(["no_such_task"], inc)
    assert [d for _, d in built] == [False, True]
    built.clear()
    assert "arc_easy" in E.lm_eval_task_manager(["arc_easy"]).all_tasks  # no include dir
    assert built == [([str(TASKS_DIR)], False), ([str(TASKS_DIR)], True)]
    built.clear()
    E.lm_eval_task_manager(["lapheads_chat_mmlu"])
    assert built == [([str(TASKS_DIR)], False)]


def test_chat_tasks_are_lm_eval_tasks_without_the_built_in_index(monkeypatch):
    from lapheads.lm import evaluate as E
    from lapheads.lm.tasks import CHAT_TASKS

    monkeypatch.setattr(E, "_offline", lambda: None)
    tm = E.lm_eval_task_manager(list(CHAT_TASKS.values()))
    assert sorted(tm.all_subtasks) == sorted(CHAT_TASKS.values())


def test_eval_lm_cli_chat_tasks(run, tmp_path, monkeypatch):
    offline(monkeypatch, tmp_path / "hf_datasets")  # what `eval lm` sets for itself, undone after the test
    arc = tmp_path / "arc.jsonl"
    arc.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"q{i}",
                    "question": f"Which is {w}?",
                    "choices": {"text": [w, "stone", "water", "air"], "label": list("ABCD")},
                    "answerKey": "A",
                }
            )
            + "\n"
            for i, w in enumerate(["fire", "wood", "sand"])
        )
    )
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}) + "\n")
    out = tmp_path / "eval.json"
    # 80 new tokens: more than the model's 64 positions, which lm-eval would refuse unless the chat
    # tasks' prompts and replies are left untruncated
    assert (
        cli(
            [
                "eval",
                "lm",
                "--run",
                str(run),
                "--tasks",
                f"arc_easy={arc},gsm8k={gsm}",
                "--max-new-tokens",
                "80",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["chat"]["arc_easy"]["total"] == 3 and res["chat"]["gsm8k"]["total"] == 1
    assert set(res["chat"]["arc_easy"]["predictions"]) <= set("ABCD") and len(res["chat"]["gsm8k"]["answers"]) == 1
    assert "chatcore" in res["chat"] and res["chat_tasks"] == {"arc_easy": str(arc), "gsm8k": str(gsm)}
    lm_res = res["chat_lm_eval"]["results"]
    assert lm_res["lapheads_chat_arc_easy"]["acc,none"] == res["chat"]["arc_easy"]["accuracy"]
    assert lm_res["lapheads_chat_gsm8k"]["exact_match,final_number"] == res["chat"]["gsm8k"]["accuracy"]
    # a bad task file fails before the model is loaded
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    assert cli(["eval", "lm", "--run", str(run), "--tasks", f"arc_easy={bad}"]) == 2


def test_parse_tasks():
    assert parse_tasks("arc_easy=a.jsonl, humaneval") == {"arc_easy": "a.jsonl", "humaneval": None}
    with pytest.raises(ConfigError):
        parse_tasks("arc_easy=a,,mmlu=b")
    with pytest.raises(ConfigError):
        parse_tasks("mmlu=a,mmlu=b")


def test_lm_eval_hflm_gets_the_laplacian_model(run):
    """lm-eval's own ``--model hf`` loader (HFLM) on a run's export, with lapheads.transformers imported."""
    pytest.importorskip("accelerate")
    from lm_eval.models.huggingface import HFLM

    import lapheads.transformers  # noqa: F401 - registers the implementation config.json names

    hf = run / "final" / "hf"
    lm = HFLM(pretrained=str(hf), device="cpu", batch_size=1, dtype="float32")
    model, tok = R.load_model(run)
    x = torch.tensor([tok.encode("The list type")])
    with torch.no_grad():
        assert torch.equal(lm._model_call(x), model(x).logits)
    assert lm.model.config.laplacian_heads == "all"


def test_lm_eval_hflm_without_lapheads_fails_naming_the_fix(run, tmp_path):
    """``lm_eval --model hf --model_args pretrained=RUN/final/hf`` never runs the model as standard attention:
    transformers asks for trust_remote_code (the checkpoint's model type is lapheads' own), and with it the
    loader file names lapheads when lapheads is not installed."""
    pytest.importorskip("accelerate")
    import os
    import subprocess
    import sys

    from test_sharing import NO_LAPHEADS

    hf = str(run / "final" / "hf")
    script = f"""
import sys
from lm_eval.models.huggingface import HFLM
for trust in (False, True):
    if trust:
{textwrap.indent(NO_LAPHEADS, "        ")}
    try:
        HFLM(pretrained={hf!r}, device="cpu", batch_size=1, trust_remote_code=trust)
    except Exception as e:
        print("RAISED", trust, type(e).__name__, e)
print("LAPHEADS", any(m.split(".")[0] == "lapheads" for m in sys.modules))
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "LAPHEADS False" in r.stdout
    assert "RAISED False ValueError" in r.stdout and "trust_remote_code=True" in r.stdout, r.stdout[-2000:]
    assert "RAISED True ImportError this checkpoint has Laplacian heads" in r.stdout, r.stdout[-2000:]


def test_eval_lm_waits_for_the_runs_writer_lock(run, tmp_path, capsys, monkeypatch):
    """eval.json goes into the run directory: a run held by another writer is refused in one line,
    before the model is loaded; once the holder is gone the evaluation writes its result."""
    import subprocess
    import sys

    offline(monkeypatch, tmp_path / "hf_datasets")
    arc = tmp_path / "arc.jsonl"
    arc.write_text(
        json.dumps(
            {
                "id": "q0",
                "question": "Which is fire?",
                "answerKey": "A",
                "choices": {"text": ["fire", "stone"], "label": ["A", "B"]},
            }
        )
        + "\n"
    )
    code = (
        "import sys; from lapheads.engine.run import RunLock; RunLock.acquire(sys.argv[1]); "
        "print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    result = run / "eval.json"  # other tests of this module may have written one already
    before = result.read_bytes() if result.exists() else None
    try:
        assert holder.stdout.readline().strip() == "held"
        real_load = R.load_model
        monkeypatch.setattr(R, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
        assert cli(["eval", "lm", "--run", str(run), "--tasks", f"arc_easy={arc}"]) == 2
        assert f"PID {holder.pid}" in capsys.readouterr().err
        assert (result.read_bytes() if result.exists() else None) == before
    finally:
        holder.kill()
        holder.wait()
    monkeypatch.setattr(R, "load_model", real_load)
    assert cli(["eval", "lm", "--run", str(run), "--tasks", f"arc_easy={arc}", "--max-new-tokens", "4"]) == 0
    assert json.loads((run / "eval.json").read_text())["chat"]["arc_easy"]["total"] == 1
