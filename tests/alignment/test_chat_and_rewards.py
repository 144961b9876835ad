"""Chat templates render the formats their models were trained on and train only the assistant's
words and end marker; the verifiers parse math answers, the R1-Zero format and scripts."""

from __future__ import annotations

import pytest

from lmlab.alignment import CHAT_TEMPLATES, REWARDS, Turn, compute_group_normalized_rewards, tokenize_chat
from lmlab.errors import ConfigError
from lmlab.tokenizers import ByteTokenizer

TURNS = [Turn("system", "Be brief."), Turn("user", "Hi"), Turn("assistant", "Hello!")]


def test_each_template_renders_its_format():
    assert CHAT_TEMPLATES.build("plain").render(TURNS) == "Be brief.\n\nUser: Hi\nAssistant: Hello!\n"
    assert CHAT_TEMPLATES.build("chatml").render(TURNS) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n")
    assert CHAT_TEMPLATES.build("llama3").render(TURNS[1:], add_generation_prompt=False) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>")
    assert CHAT_TEMPLATES.build("chatml").render(TURNS[:2], add_generation_prompt=True).endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_tokenize_chat_trains_only_the_assistant_content_and_its_end_marker():
    tokenizer = ByteTokenizer(ByteTokenizer.Config(special_tokens=["<|im_start|>", "<|im_end|>"]))
    ids, trained = tokenize_chat(TURNS, tokenizer, CHAT_TEMPLATES.build("chatml"))
    assert tokenizer.decode(ids) == CHAT_TEMPLATES.build("chatml").render(TURNS)
    learned = [i for i, t in zip(ids, trained) if t]
    assert tokenizer.decode(learned) == "Hello!<|im_end|>"
    with pytest.raises(ConfigError, match="needs the special tokens <\\|begin_of_text\\|>"):
        tokenize_chat(TURNS, tokenizer, CHAT_TEMPLATES.build("llama3"))


@pytest.mark.parametrize("turns, match", [
    ([Turn("user", "Hi")], "no assistant turn"),
    ([Turn("bot", "Hi"), Turn("assistant", "Yo")], "role 'bot'"),
    ([], "no turns"),
])
def test_bad_chat_examples_are_one_clear_error(turns, match):
    with pytest.raises(ConfigError, match=match):
        CHAT_TEMPLATES.build("plain").segments(turns)


def test_math_reward_compares_values_not_strings():
    pytest.importorskip("math_verify")
    reward = REWARDS.build("math")
    for answer, truth in [("0.5", "\\frac{1}{2}"), ("1,000", "1000"), ("x = 3", "3"), ("<answer>72.0</answer>", "72"),
                          ("\\{1, 2\\}", "\\{2, 1\\}")]:
        assert reward(answer, truth)["reward"] == 1.0, (answer, truth)
    assert reward("<answer>5</answer> or 4", "4")["reward"] == 0.0  # the tagged answer is what counts


def test_r1_zero_reward_needs_the_format_and_the_answer():
    pytest.importorskip("math_verify")
    reward = REWARDS.build("r1_zero")
    assert reward("<think>2 + 2</think> <answer>4</answer>", "4") == {
        "format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}
    assert reward("<think>2 + 2</think> <answer>5</answer>", "4")["format_reward"] == 1.0
    assert reward("<think>2 + 2</think> <answer>5</answer>", "4")["reward"] == 0.0
    assert reward("<answer>4</answer>", "4")["reward"] == 0.0  # no reasoning block: no format
    assert REWARDS.build("format")("<think>a</think>\n<answer>b</answer>", "")["reward"] == 1.0
    advantages, raw, meta = compute_group_normalized_rewards(
        reward, ["<think>.</think> <answer>4</answer>", "4"], ["4", "4"], group_size=2, normalize_by_std=False)
    assert raw.tolist() == [1.0, 0.0] and meta["format_reward_mean"] == 0.5


def test_exact_match_and_language_consistency():
    exact = REWARDS.build({"name": "exact_match", "ignore_case": True})
    assert exact(" Paris ", "paris")["reward"] == 1.0 and exact("<answer>Lyon</answer>", "Paris")["reward"] == 0.0
    consistency = REWARDS.build("language_consistency")
    assert consistency("all english words", "")["reward"] == 1.0
    assert consistency("ab你好", "")["reward"] == 0.5
    assert REWARDS.build({"name": "language_consistency", "script": "cjk"})("ab你好", "")["reward"] == 0.5
    assert consistency("123 !", "")["reward"] == 0.0
