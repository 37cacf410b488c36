"""Chat evaluation: multiple-choice scoring, GSM8K extraction, pass@k, HumanEval end to end, and a
tiny random transformers model through evaluate_tasks."""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lapheads.data.tasks import TaskItem, load_task
from lapheads.errors import ConfigError, DataError
from lapheads.lm.chat_eval import (answer_token_ids, evaluate_humaneval, evaluate_multiple_choice,
                                   evaluate_tasks, extract_answer, extract_code, make_generator,
                                   pass_at_k, render_multiple_choice)

LETTER_COUNT = 4


class CharTokenizer:
    """Bytes as tokens, no special tokens (so the plain-text prompt format is used)."""

    pad_token_id = 0
    eos_token_id = 3

    def encode(self, text, add_special_tokens=False):
        return ([1] if add_special_tokens else []) + [min(b, 250) + 5 for b in text.encode()]

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i - 5 for i in ids if i >= 5).decode("utf-8", "replace")


class HashLM(nn.Module):
    """Logits with a known answer: at position t it favours letter (sum of real tokens <= t) % 4.

    Padded positions favour a *different* letter, so reading the wrong position (or letting the
    pads into the sum) changes the prediction.
    """

    def __init__(self, letter_ids, vocab=256):
        super().__init__()
        self.register_buffer("letters", torch.tensor(letter_ids))
        self.vocab = vocab
        self.calls = 0

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        self.calls += 1
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        choice = (input_ids * mask).cumsum(1) % LETTER_COUNT
        choice = torch.where(mask.bool(), choice, (choice + 1) % LETTER_COUNT)
        logits = torch.zeros(*input_ids.shape, self.vocab)
        logits.scatter_(2, self.letters[choice].unsqueeze(-1), 5.0)
        return SimpleNamespace(logits=logits)


def _mc_items(n=11):
    items = []
    for i in range(n):
        k = 3 if i % 5 == 4 else 4
        items.append(TaskItem("mmlu", "choice", str(i), f"Question number {i}{'?' * (i % 3)}",
                              choices=[f"option {j} of {i}" for j in range(k)], answer_index=i % k))
    return items


def test_multiple_choice_matches_expected_and_is_padding_invariant():
    tok = CharTokenizer()
    render = lambda msgs: [1] + tok.encode(msgs[0]["content"])  # noqa: E731
    shared, letter_ids = answer_token_ids(tok, "ABCD", " ")
    assert shared == tok.encode(" ") and letter_ids == [tok.encode(c)[0] for c in "ABCD"]
    items = _mc_items()
    expected_correct = 0
    for it in items:
        fav = sum(render([{"role": "user", "content": render_multiple_choice(it)}]) + shared) % 4
        pred = fav if fav < len(it.choices) else 0  # letters past the choices are excluded
        expected_correct += int(pred == it.answer_index)
    model = HashLM(letter_ids)
    runs = [evaluate_multiple_choice(model, tok, items, render, " ", batch_size=bs, padding_side=side,
                                     progress=False)
            for side in ("left", "right") for bs in (1, 4, 11)]
    assert all(r["predictions"] == runs[0]["predictions"] for r in runs)
    assert all(r["correct"] == expected_correct and r["total"] == len(items) for r in runs)
    assert runs[0]["accuracy"] == pytest.approx(expected_correct / len(items))
    assert 0 < expected_correct < len(items)  # the check can tell right from wrong


def test_answer_letters_must_be_distinct_tokens():
    class Collapsing(CharTokenizer):
        def encode(self, text, add_special_tokens=False):
            return [7] * len(text)
    with pytest.raises(ConfigError, match="distinct tokens"):
        answer_token_ids(Collapsing(), "AB", "")


@pytest.mark.parametrize("text,expected", [
    ("so the total is 42.\n#### 42", "42"),
    ("#### 1,234", "1234"),
    ("She pays $5.50 then $3.", "3"),
    ("The answer is 18 apples and 7 pears, 25 in total", "25"),
    ("#### -7 degrees", "-7"),
    ("first #### 3 then #### 4", "4"),
    ("Answer: 12.00", "12"),
    ("no number here", None),
    ("#### none\nbut the result is 9", "9"),
])
def test_gsm8k_answer_extraction(text, expected):
    assert extract_answer(text) == expected


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


def test_humaneval_end_to_end_with_fake_generator():
    items = load_task("humaneval", max_items=6)
    index = {it.question: i for i, it in enumerate(items)}
    render = lambda msgs: [index[msgs[0]["content"]]]  # noqa: E731
    n = 3
    good_counts = [3, 0, 2, 1, 3, 0]  # correct samples per problem

    def fake_generate(prompts, num_samples):
        assert num_samples == n
        out = []
        for (i,) in prompts:
            it = items[i]
            right = it.solution
            if i == 4:  # chat style: the whole function in a fenced block
                right = f"Sure!\n```python\n{it.question}{it.solution}```\nHope it helps."
            out.append([right if s < good_counts[i] else "    return None\n" for s in range(n)])
        return out

    res = evaluate_humaneval(items, fake_generate, render, num_samples=n, ks=(1, 2, 5),
                             timeout=5, workers=2, progress=False)
    assert res["per_problem"] == {it.id: c for it, c in zip(items, good_counts)}
    assert res["pass@1"] == pytest.approx(sum(good_counts) / (n * len(items)))
    assert res["pass@2"] == pytest.approx(sum(_brute_pass_at_k(n, c, 2) for c in good_counts) / len(items))
    assert "pass@5" not in res and res["total"] == 6 and res["passed_samples"] == sum(good_counts)
    assert res["statuses"] == {"passed": sum(good_counts), "failed": n * 6 - sum(good_counts)}


# ---------------------------------------------------------------------- tiny transformers model
def _chat_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>", "<|pad|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["Multiple Choice question: which answer is right?",
                                 "def add(a, b):\n    return a + b\n", "#### 42"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|bos|>",
                                   eos_token="<|assistant_end|>", pad_token="<|pad|>",
                                   additional_special_tokens=specials[1:4] + specials[5:9])


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_tiny_llama_through_evaluate_tasks(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _chat_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg)
    arc = _write_jsonl(tmp_path / "arc.jsonl", [
        {"id": f"a{i}", "question": f"Question {i}?", "answerKey": "ABC"[i],
         "choices": {"text": ["red", "green", "blue"], "label": ["A", "B", "C"]}} for i in range(3)])
    mmlu = _write_jsonl(tmp_path / "mmlu.jsonl", [
        {"question": f"Q{i}", "subject": "x", "choices": ["1", "2", "3", "4"], "answer": i} for i in range(4)])
    gsm = _write_jsonl(tmp_path / "gsm.jsonl", [
        {"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(3)])
    res = evaluate_tasks(model, tok, {"arc_easy": arc, "mmlu": mmlu, "gsm8k": gsm, "humaneval": None},
                         max_items=3, batch_size=2, max_new_tokens=6, sandbox_timeout=5,
                         progress=False)
    assert set(res) == {"arc_easy", "mmlu", "gsm8k", "humaneval", "chatcore"}
    for name in ("arc_easy", "mmlu", "gsm8k"):
        r = res[name]
        assert r["total"] == 3 and 0 <= r["correct"] <= 3
        assert 0.0 <= r["accuracy"] <= 1.0 and r["accuracy"] == pytest.approx(r["correct"] / 3)
    assert len(res["arc_easy"]["predictions"]) == 3 and set(res["arc_easy"]["predictions"]) <= set("ABC")
    assert res["mmlu"]["baseline"] == pytest.approx(0.25)
    assert len(res["gsm8k"]["answers"]) == 3
    he = res["humaneval"]
    assert he["total"] == 3 and he["num_samples"] == 1 and 0.0 <= he["pass@1"] <= 1.0
    assert sum(he["statuses"].values()) == 3
    assert math.isfinite(res["chatcore"])

    # Multiple-choice predictions do not depend on padding side or batch size for a real model.
    items = load_task("mmlu", mmlu)
    a = evaluate_multiple_choice(model, tok, items, batch_size=4, padding_side="left", progress=False)
    b = evaluate_multiple_choice(model, tok, items, batch_size=1, padding_side="right", progress=False)
    assert a["predictions"] == b["predictions"]

    # Greedy generation: transformers' generate and the plain recompute loop agree.
    prompts = [tok.encode("hello", add_special_tokens=False), tok.encode("def", add_special_tokens=False)]
    hf = make_generator(model, tok, max_new_tokens=5)(prompts, 1)
    plain = make_generator(lambda input_ids, attention_mask=None, position_ids=None:
                           model(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids),
                           tok, max_new_tokens=5, device=torch.device("cpu"))(prompts, 1)
    assert hf == plain


def test_bad_task_file_fails_before_the_model_runs(tmp_path):
    model = HashLM([10, 11, 12, 13])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "choices": ["a", "b"]}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: missing field 'answer'"):
        evaluate_tasks(model, CharTokenizer(), {"mmlu": str(bad)}, progress=False)
    assert model.calls == 0
    with pytest.raises(ConfigError, match="temperature"):
        make_generator(model, CharTokenizer(), temperature=0.0)([[1]], 2)
