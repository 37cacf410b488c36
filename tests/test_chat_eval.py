"""Chat evaluation through lm-evaluation-harness (lapheads.lm.tasks): prompts, multiple-choice accuracy
against the model's own letter log-likelihoods, GSM8K answers against greedy replies and known
replies, HumanEval pass@k through the sandbox, and the checks made before any model work."""

from __future__ import annotations

import itertools
import json
import os
from types import SimpleNamespace

import pytest
import torch
from _lm_helpers import chat_task_files, offline, scripted_lm

from lapheads.data.benchmarks import LETTERS, load_benchmark
from lapheads.errors import ConfigError, DataError
from lapheads.lm.tasks import (
    CHAT_TASKS,
    TASKS_DIR,
    chat_prompt,
    choice_doc_to_text,
    extract_answer,
    extract_code,
    pass_at_k,
    render_multiple_choice,
)
from lapheads.lm.tokenizer import render_chat
from lapheads.sandbox import sandbox_status

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.xdist_group("chat_eval")  # one random model and one set of task files per module


def _chat_tokenizer():
    """A small byte-level BPE with this project's special tokens (what render_chat needs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [
        "<|bos|>",
        "<|user_start|>",
        "<|user_end|>",
        "<|assistant_start|>",
        "<|assistant_end|>",
        "<|python_start|>",
        "<|python_end|>",
        "<|output_start|>",
        "<|output_end|>",
        "<|pad|>",
    ]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(
        ["Multiple Choice question: which answer is right?", "def add(a, b):\n    return a + b\n", "#### 42"], trainer
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|bos|>",
        eos_token="<|assistant_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=specials[1:4] + specials[5:9],
    )


@pytest.fixture(scope="module")
def llama():
    """A random tiny Llama whose answers differ from item to item (large initial weights), with a
    lapheads run's generation config: a reply ends at <|assistant_end|> or <|bos|>."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = _chat_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        initializer_range=0.5,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.bos_token_id]
    return model, tok


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return chat_task_files(tmp_path_factory.mktemp("chat_tasks"), humaneval=6)


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    offline(monkeypatch, tmp_path / "hf_datasets")


def _user_message(name, item):
    return render_multiple_choice(item) if item.kind == "choice" else item.question


# ------------------------------------------------------------------------------------ prompts
def test_prompts_are_render_chat_with_one_bos(llama, files):
    """What lm-eval's HFLM feeds the model is exactly render_chat(..., add_generation_prompt=True)."""
    from lapheads.lm.evaluate import make_lm_eval_model

    model, tok = llama
    lm = make_lm_eval_model(model, tok)
    for name, path in files.items():
        for item in load_benchmark(name, path):
            want = render_chat(
                tok, [{"role": "user", "content": _user_message(name, item)}], add_generation_prompt=True
            )[0]
            assert lm.tok_encode(chat_prompt(_user_message(name, item))) == want, (name, item.id)
            if item.kind == "choice":
                lines = render_multiple_choice(item).splitlines()
                assert [f"- {c}={L}" for c, L in zip(item.choices, LETTERS)] == [x for x in lines if x.startswith("- ")]
    row = json.loads(open(files["arc_challenge"]).readline())  # the original AI2 layout: labels 1-3 become A-C
    item = load_benchmark("arc_challenge", files["arc_challenge"])[0]
    assert choice_doc_to_text(row) == chat_prompt(render_multiple_choice(item))
    assert item.meta["labels"] == ["1", "2", "3"] and item.letters == ["A", "B", "C"]


def test_the_task_directory_indexes_the_five_chat_tasks():
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    assert tm.all_subtasks == sorted(CHAT_TASKS.values()) and tm.all_tags == ["lapheads_chat"]


# --------------------------------------------------------------------------- multiple choice
def test_multiple_choice_accuracy_is_the_argmax_of_the_letters_log_likelihoods(llama, files, no_hub):
    """Reference computed here: one forward pass per prompt, the next-token log-probabilities of the
    letters of its choices, argmax; lm-eval's acc and the report's predictions must agree with it."""
    from lapheads.lm.evaluate import run_chat_tasks

    model, tok = llama
    names = ("arc_easy", "arc_challenge", "mmlu")
    res = run_chat_tasks(model, tok, {n: files[n] for n in names}, batch_size=3, bootstrap_iters=0)
    letter_ids = [tok.encode(L, add_special_tokens=False) for L in LETTERS[:4]]
    assert all(len(i) == 1 for i in letter_ids)
    all_preds = []
    for name in names:
        items = load_benchmark(name, files[name])
        preds = []
        for item in items:
            ids = render_chat(
                tok, [{"role": "user", "content": render_multiple_choice(item)}], add_generation_prompt=True
            )[0]
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            scores = [float(lp[letter_ids[j][0]]) for j in range(len(item.choices))]
            preds.append(max(range(len(scores)), key=scores.__getitem__))
        r = res["chat"][name]
        assert r["predictions"] == [LETTERS[p] for p in preds], name
        want = sum(p == it.answer_index for p, it in zip(preds, items)) / len(items)
        assert r["accuracy"] == pytest.approx(want) and r["total"] == len(items)
        assert res["lm_eval"]["results"][CHAT_TASKS[name]]["acc,none"] == pytest.approx(want)
        assert r["baseline"] == pytest.approx(sum(1 / len(it.choices) for it in items) / len(items))
        all_preds += preds
    assert len(set(all_preds)) > 1  # the reference can tell one answer from another
    centered = [
        (res["chat"][n]["accuracy"] - res["chat"][n]["baseline"]) / (1 - res["chat"][n]["baseline"]) for n in names
    ]
    assert res["chat"]["chatcore"] == pytest.approx(sum(centered) / len(centered))


# --------------------------------------------------------------------------------------- GSM8K
@pytest.mark.parametrize(
    "text,expected",
    [
        ("so the total is 42.\n#### 42", "42"),
        ("#### 1,234", "1234"),
        ("She pays $5.50 then $3.", "3"),
        ("The answer is 18 apples and 7 pears, 25 in total", "25"),
        ("#### -7 degrees", "-7"),
        ("first #### 3 then #### 4", "4"),
        ("Answer: 12.00", "12"),
        ("no number here", None),
        ("#### none\nbut the result is 9", "9"),
    ],
)
def test_gsm8k_answer_extraction(text, expected):
    assert extract_answer(text) == expected


def test_gsm8k_exact_match_of_known_replies(files, no_hub):
    from lapheads.lm.evaluate import evaluate_chat_lm

    items = load_benchmark("gsm8k", files["gsm8k"])
    assert [it.target for it in items] == ["5", "15", "14", "9"]
    replies = ["2 + 3 = 5\n#### 5", "He has 15 apples.", "#### 13", "I do not know."]
    lm = scripted_lm({chat_prompt(it.question): [r] for it, r in zip(items, replies)})
    r = evaluate_chat_lm(lm, {"gsm8k": files["gsm8k"]}, bootstrap_iters=0)["chat"]["gsm8k"]
    assert r["answers"] == ["5", "15", "13", None] and r["correct"] == 2 and r["accuracy"] == pytest.approx(0.5)
    assert sorted(lm.asked) == sorted(chat_prompt(it.question) for it in items)


def test_gsm8k_answers_are_the_final_numbers_of_greedy_replies(llama, files, no_hub):
    """Reference computed here: greedy tokens by full recompute, cut at the first stop token."""
    from lapheads.lm.evaluate import run_chat_tasks

    model, tok = llama
    n_new, stops = 12, set(model.generation_config.eos_token_id)
    r = run_chat_tasks(model, tok, {"gsm8k": files["gsm8k"]}, batch_size=3, max_new_tokens=n_new, bootstrap_iters=0)[
        "chat"
    ]["gsm8k"]
    want = []
    for item in load_benchmark("gsm8k", files["gsm8k"]):
        seq = render_chat(tok, [{"role": "user", "content": item.question}], add_generation_prompt=True)[0]
        new = []
        with torch.no_grad():
            for _ in range(n_new):
                t = int(model(torch.tensor([seq + new])).logits[0, -1].argmax())
                if t in stops:
                    break
                new.append(t)
        want.append(extract_answer(tok.decode(new, skip_special_tokens=True)))
    assert r["answers"] == want and any(a is not None for a in want)


# ----------------------------------------------------------------------------------- HumanEval
def _brute_pass_at_k(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12)
    assert pass_at_k(200, 13, 1) == pytest.approx(13 / 200)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_extract_code():
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone") == "def f():\n    return 1\n"
    assert extract_code("    return 1\n") == "    return 1\n"


def test_humaneval_pass_at_k_of_passing_and_failing_completions_run_in_the_sandbox(files, no_hub, monkeypatch):
    """10 samples per problem, right (the canonical body; problem 4 as a whole function in a fenced
    block, chat style) or wrong (``return None``), run by the lm-eval task through lapheads.sandbox."""
    from lapheads.lm.evaluate import evaluate_chat_lm

    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    items = load_benchmark("humaneval", files["humaneval"])
    n, good = 10, [10, 0, 7, 1, 10, 3]
    replies = {}
    for i, it in enumerate(items):
        right = it.solution if i != 4 else f"Sure!\n```python\n{it.question}{it.solution}```\nHope it helps."
        replies[chat_prompt(it.question)] = [right if s < good[i] else "    return None\n" for s in range(n)]
    unsafe = not sandbox_status().available  # the canonical solutions are trusted code
    r = evaluate_chat_lm(
        scripted_lm(replies),
        {"humaneval": files["humaneval"]},
        num_samples=n,
        temperature=0.7,
        allow_unsafe_code=unsafe,
        bootstrap_iters=0,
    )["chat"]["humaneval"]
    assert r["per_problem"] == {it.id: c for it, c in zip(items, good)}
    assert r["statuses"] == {"passed": sum(good), "failed": n * len(items) - sum(good)}
    assert r["pass@1"] == pytest.approx(sum(good) / (n * len(items))) == r["accuracy"]
    assert r["pass@10"] == pytest.approx(sum(_brute_pass_at_k(n, c, 10) for c in good) / len(items))
    assert "pass@100" not in r and r["num_samples"] == n and r["passed_samples"] == sum(good)
    assert "HF_ALLOW_CODE_EVAL" not in os.environ


# ------------------------------------------------------------------- checks before the model
def test_bad_task_file_fails_before_the_model_runs(tmp_path):
    from lapheads.lm.evaluate import run_chat_tasks

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "choices": ["a", "b"]}\n')
    never = SimpleNamespace()  # any use of the model or the tokenizer would raise AttributeError
    with pytest.raises(DataError, match=r"bad\.jsonl:1: missing field 'answer'"):
        run_chat_tasks(never, never, {"mmlu": str(bad)})
    with pytest.raises(ConfigError, match="temperature"):
        run_chat_tasks(never, never, {"mmlu": str(bad)}, num_samples=2)


def test_check_chat_tasks_sources(files):
    from lapheads.data.benchmarks import builtin_humaneval_path
    from lapheads.lm.evaluate import check_chat_tasks

    assert check_chat_tasks({"ARC-Easy": files["arc_easy"]}) == {"ARC-Easy": files["arc_easy"]}
    with pytest.raises(ConfigError, match="mmlu"):
        check_chat_tasks({"mmlu": None})  # no file, and the Hub is off
    assert check_chat_tasks({"mmlu": None}, allow_network=True) == {"mmlu": "hub"}
    if builtin_humaneval_path() is not None and sandbox_status().available:
        assert check_chat_tasks({"humaneval": None}) == {"humaneval": builtin_humaneval_path()}
    with pytest.raises(ConfigError, match="arc_easy"):
        check_chat_tasks({"arc_easy": files["arc_easy"], "ARC-Easy": files["arc_easy"]})


def test_chat_tasks_need_the_chat_special_tokens(files):
    from lapheads.lm.evaluate import run_chat_tasks

    with pytest.raises(ConfigError, match="user_start"):
        run_chat_tasks(SimpleNamespace(), SimpleNamespace(get_vocab=lambda: {"<|bos|>": 0}), {"mmlu": files["mmlu"]})
