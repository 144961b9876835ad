"""The tasks on the fixtures: MMLU picks the most likely letter (per-subject and macro accuracy, limit per
subject, 25% for a model that knows nothing), the generative tasks parse and score what a scorer
returns (GSM8K's pass@k), perplexity's bits per byte; bad settings fail when the task is built."""

from __future__ import annotations

import csv
import math
import random
from pathlib import Path

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.eval import EVAL_TASKS, Scorer
from lmlab.eval.answers import pass_at_k
from lmlab.nn import ModelConfig, Transformer
from lmlab.tokenizers import ByteTokenizer

FIXTURES = Path(__file__).parent / "fixtures"


def _scorer(max_seq_len=2048, seed=0) -> Scorer:
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, n_layers=2, max_seq_len=max_seq_len, norm="rmsnorm", ffn="swiglu",
                      position="rope", attention={"name": "mha", "n_heads": 4}, block="prenorm")
    tokenizer = ByteTokenizer()
    return Scorer(Transformer(cfg, vocab_size=tokenizer.vocab_size).eval(), tokenizer, max_seq_len)


class CannedScorer:
    """A scorer whose generations are given: what the generative tasks make of them."""

    def __init__(self, completions: list[str]):
        self.tokenizer, self.truncated, self.completions, self.prompts = ByteTokenizer(), 0, completions, []

    def generate(self, prompts, sampler, max_new_tokens, stop_strings=(), batch_size=32, desc=""):
        self.prompts += prompts
        return self.completions[:len(prompts)]


def test_mmlu_picks_the_most_likely_letter_and_tables_each_subject():
    scorer = _scorer()
    task = EVAL_TASKS.build({"name": "mmlu", "path": str(FIXTURES / "mmlu"), "shots": 2})
    result = task.run(scorer, limit=3)
    assert result.examples == 6 and [row["questions"] for row in result.table] == [3, 3]
    assert result.metrics["acc"] == pytest.approx(sum(row["acc"] for row in result.table) / 2)
    question, record = task.data.limited(3)[0], result.records[0]
    prompt = task.data.prompt(question)
    assert prompt.count("Answer:") == 3  # two dev examples of the subject, then the question
    logprobs = []
    for letter in "ABCD":  # brute force: the prompt and the letter in one forward each
        ids = scorer.tokenizer.encode(prompt + f" {letter}")
        with torch.no_grad():
            rows = scorer.model(torch.tensor([ids])).float().log_softmax(-1)[0]
        logprobs.append(sum(rows[i - 1, ids[i]].item() for i in range(len(ids) - 2, len(ids))))
    assert record["logprobs"] == pytest.approx(logprobs, abs=1e-4)
    assert record["predicted"] == "ABCD"[max(range(4), key=logprobs.__getitem__)]
    assert record["correct"] == (record["predicted"] == question.answer)


def test_mmlu_continuation_scores_each_option_text_and_normalises_by_its_length():
    scorer = _scorer()
    task = EVAL_TASKS.build({"name": "mmlu_continuation", "path": str(FIXTURES / "mmlu"), "shots": 1})
    result = task.run(scorer, limit=2)
    assert result.task == "mmlu_continuation" and result.examples == 4
    assert set(result.metrics) == {"acc", "acc_micro", "acc_norm", "acc_norm_micro"}
    question, record = task.data.limited(2)[0], result.records[0]
    prompt = task.data.prompt(question)
    assert "\nA. " not in prompt and prompt.endswith("\nAnswer:")
    options = [f" {choice}" for choice in question.choices]
    logprobs = []
    for option in options:  # brute force: the prompt and the option in one forward each
        ids = scorer.tokenizer.encode(prompt + option)
        with torch.no_grad():
            rows = scorer.model(torch.tensor([ids])).float().log_softmax(-1)[0]
        logprobs.append(sum(rows[i - 1, ids[i]].item() for i in range(len(ids) - len(option), len(ids))))
    assert record["logprobs"] == pytest.approx(logprobs, abs=1e-4)
    per_char = [lp / len(option) for lp, option in zip(logprobs, options)]
    assert record["predicted"] == "ABCD"[max(range(4), key=logprobs.__getitem__)]
    assert record["predicted_norm"] == "ABCD"[max(range(4), key=per_char.__getitem__)]
    assert record["correct_norm"] == (record["predicted_norm"] == question.answer)


def test_a_model_that_knows_nothing_scores_a_quarter(tmp_path):
    rng = random.Random(0)
    for split, count in (("test", 3000), ("dev", 1)):
        (tmp_path / split).mkdir()
        with open(tmp_path / split / f"trivia_{split}.csv", "w", newline="") as f:
            csv.writer(f).writerows([f"Question {i}: which {rng.randint(0, 999)}?", *(f"{rng.randint(0, 99)}"
                                     for _ in range(4)), rng.choice("ABCD")] for i in range(count))
    result = EVAL_TASKS.build({"name": "mmlu", "path": str(tmp_path), "shots": 0}).run(_scorer(seed=3), None)
    assert result.examples == 3000
    assert result.metrics["acc"] == pytest.approx(0.25, abs=0.015)
    assert result.metrics["acc_norm"] == result.metrics["acc"]  # the letters are all one character long


def test_gsm8k_parses_the_final_number_and_estimates_pass_at_k():
    completions = [" 18 eggs... #### 18", " so 3", " The answer is 20.", " #### 1,200", " no idea",
                   " 7 #### 18", " 18", " it is 18."]
    scorer = CannedScorer(completions)
    task = EVAL_TASKS.build({"name": "gsm8k", "path": str(FIXTURES / "gsm8k"), "shots": 1, "n": 4, "k": [1, 2, 4],
                             "temperature": 0.7})
    result = task.run(scorer, limit=2)
    references = task.references[:2]
    solved = [sum(r["correct"]) for r in result.records]
    assert len(scorer.prompts) == 8 and scorer.prompts[0] == scorer.prompts[3]  # n samples of each problem
    assert [r["reference"] for r in result.records] == [str(x) for x in references]
    assert result.metrics["unparsed"] == pytest.approx(1 / 8)
    for k in (1, 2, 4):
        assert result.metrics[f"pass@{k}"] == pytest.approx(sum(pass_at_k(4, c, k) for c in solved) / 2)
    assert result.metrics["exact_match"] == pytest.approx(sum(solved) / 8)


def test_mmlu_generative_parses_letters_and_reports_the_unparsed():
    scorer = CannedScorer([" The correct answer is B.", " (C)", " I am not sure", " A. Paris"] * 4)
    task = EVAL_TASKS.build({"name": "mmlu_generative", "path": str(FIXTURES / "mmlu"), "shots": 0})
    result = task.run(scorer, limit=2)
    assert [r["parsed"] for r in result.records] == ["B", "C", None, "A"]
    assert result.metrics["unparsed"] == 0.25
    assert result.metrics["acc_micro"] == pytest.approx(
        sum(r["parsed"] == r["answer"] for r in result.records) / 4)


def test_perplexity_of_a_file_in_bits_per_byte(tmp_path):
    text = "The quick brown fox jumps over the lazy dog. " * 8
    (tmp_path / "t.txt").write_text(text)
    scorer = _scorer(max_seq_len=64)
    result = EVAL_TASKS.build({"name": "perplexity", "path": str(tmp_path / "t.txt"), "stride": 32}).run(scorer, None)
    nll, count = scorer.rolling_nll(scorer.tokenizer.encode(text), 32)
    assert result.metrics["tokens"] == count == len(text) - 1  # bytes are tokens here
    assert result.metrics["bpb"] == pytest.approx(nll / math.log(2) / (len(text) - 1))
    assert result.metrics["ppl"] == pytest.approx(math.exp(nll / count))


def test_perplexity_counts_no_bytes_for_end_of_text(tmp_path):
    """As training's val/bpb: an end-of-text token marks a boundary; its 13 characters are not text."""
    text = "The quick brown fox.<|endoftext|>The lazy dog. " * 4
    (tmp_path / "t.txt").write_text(text)
    scorer = _scorer(max_seq_len=64)
    result = EVAL_TASKS.build({"name": "perplexity", "path": str(tmp_path / "t.txt")}).run(scorer, None)
    nll, _ = scorer.rolling_nll(scorer.tokenizer.encode(text), None)
    text_bytes = len(text.replace("<|endoftext|>", "")) - 1  # the first token is not scored
    assert result.metrics["bpb"] == pytest.approx(nll / math.log(2) / text_bytes)


@pytest.mark.parametrize("cfg, match", [
    ({"name": "mmlu"}, "eval.mmlu.path"),
    ({"name": "mmlu", "path": str(FIXTURES / "mmlu"), "shots": 6}, "has 5"),
    ({"name": "mmlu", "path": str(FIXTURES / "mmlu"), "subjects": ["abstract_algebr"]}, "abstract_algebra"),
    ({"name": "gsm8k", "path": str(FIXTURES / "gsm8k"), "n": 2, "k": [4]}, "each k must be in 1..n"),
    ({"name": "gsm8k", "path": str(FIXTURES / "gsm8k"), "shots": 9}, "has 4 problems"),
    ({"name": "gsm8k", "path": "/nonexistent"}, "nonexistent"),
    ({"name": "perplexity", "path": "/nonexistent.txt"}, "not a file"),
    ({"name": "mmlu_generativ"}, "Did you mean 'mmlu_generative'"),
])
def test_bad_settings_fail_when_the_task_is_built(cfg, match):
    with pytest.raises(ConfigError, match=match):
        EVAL_TASKS.build(cfg)
