"""The functional core against hand-computed values: masked reductions (empty rows, nan outside the
mask), tokenising prompt + output, log-probs and entropy, group-normalised rewards, GAE."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.alignment import (compute_entropy, compute_group_normalized_rewards, generalized_advantage_estimation,
                             get_response_log_probs, masked_mean, masked_normalize, tokenize_prompt_and_output)
from lmlab.nn import ModelConfig, Transformer
from lmlab.tokenizers import ByteTokenizer
from lmlab.tokenizers.hf_files import save_hf_tokenizer


def test_masked_mean_and_normalize_by_hand_with_an_empty_row_and_nan_outside_the_mask():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("-inf"), 6.0], [7.0, 8.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    assert masked_mean(x, mask, dim=-1).tolist() == [1.5, 5.0, 0.0]
    assert masked_mean(x, mask).item() == pytest.approx(13 / 4)
    assert masked_normalize(x, mask, 2.0, dim=-1).tolist() == [1.5, 5.0, 0.0]
    assert masked_normalize(x, mask, 4.0, dim=0).tolist() == [5 / 4, 2 / 4, 6 / 4]
    masked_mean(x, mask, dim=-1).sum().backward()
    assert x.grad.tolist() == [[0.5, 0.5, 0.0], [0.5, 0.0, 0.5], [0.0, 0.0, 0.0]]  # finite, none outside the mask


def test_tokenize_prompt_and_output_shifts_labels_and_masks_only_the_output():
    out = tokenize_prompt_and_output(["ab", "c"], ["xyz", "w"], ByteTokenizer())
    assert out["input_ids"].shape == out["labels"].shape == out["response_mask"].shape == (2, 4)
    assert out["input_ids"][0].tolist() == list(b"abxy") and out["labels"][0].tolist() == list(b"bxyz")
    assert out["response_mask"].tolist() == [[False, True, True, True], [True, False, False, False]]
    assert out["labels"][1, 0].item() == ord("w")  # after the prompt "c", the label is the output's first byte


def test_a_hugging_face_tokenizer_gives_the_same_tensors(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = ByteTokenizer(ByteTokenizer.Config(special_tokens=["<|endoftext|>"]))
    save_hf_tokenizer(tokenizer, tmp_path, model_max_length=64)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    prompts, outputs = ["Question: 2+2?", "Hi"], [" 4", " there, you"]
    ours, theirs = (tokenize_prompt_and_output(prompts, outputs, t) for t in (tokenizer, hf))
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_entropy_and_response_log_probs_against_a_full_log_softmax():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1000.0, 0.0, 0.0, 0.0]]])
    assert compute_entropy(logits)[0].tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=1, max_seq_len=16, norm="rmsnorm", ffn="swiglu", position="rope",
                      attention={"name": "mha", "n_heads": 4}, block="prenorm")
    model = Transformer(cfg, vocab_size=64)
    ids = torch.randint(0, 64, (2, 9))
    out = get_response_log_probs(model, ids[:, :-1], ids[:, 1:], return_token_entropy=True)
    full = model(ids[:, :-1]).log_softmax(-1)
    torch.testing.assert_close(out["log_probs"], full.gather(-1, ids[:, 1:, None]).squeeze(-1))
    torch.testing.assert_close(out["token_entropy"], -(full.exp() * full).sum(-1))


def _reward(response: str, truth: str) -> dict[str, float]:
    return {"reward": float(response == truth), "format_reward": 1.0}


def test_group_normalized_rewards_with_and_without_the_std():
    responses, truths = ["1", "2", "3", "3", "5", "6"], ["3"] * 6
    advantages, raw, meta = compute_group_normalized_rewards(_reward, responses, truths, 3, 1e-6, False)
    assert raw.tolist() == [0, 0, 1, 1, 0, 0]
    assert advantages.tolist() == pytest.approx([-1 / 3, -1 / 3, 2 / 3, 2 / 3, -1 / 3, -1 / 3])
    scaled, _, _ = compute_group_normalized_rewards(_reward, responses, truths, 3, 1e-6, True)
    std = torch.tensor([0.0, 0.0, 1.0]).std().item()  # unbiased, as torch.std
    assert scaled.tolist() == pytest.approx([a / (std + 1e-6) for a in advantages.tolist()])
    assert meta["reward_mean"] == pytest.approx(1 / 3) and meta["format_reward_mean"] == 1.0
    same, _, _ = compute_group_normalized_rewards(_reward, ["3"] * 3, ["3"] * 3, 3, 1e-6, True)
    assert same.tolist() == [0.0, 0.0, 0.0]  # a group that all agrees teaches nothing, and is not nan


def test_group_size_that_does_not_divide_the_batch_is_refused():
    with pytest.raises(ValueError, match="group_size=4 does not divide the rollout batch of 6"):
        compute_group_normalized_rewards(_reward, ["1"] * 6, ["1"] * 6, 4)


def _gae_loop(rewards, values, length, gamma, lam):
    """Textbook GAE over one row's first `length` tokens."""
    advantages, running = [0.0] * length, 0.0
    for t in reversed(range(length)):
        next_value = values[t + 1] if t + 1 < length else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        advantages[t] = running
    return advantages


def test_gae_matches_the_textbook_loop_on_ragged_rows():
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 6), torch.randn(3, 6)
    lengths = [6, 4, 1]
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])
    advantages, returns = generalized_advantage_estimation(rewards, values, mask, gamma=0.9, lam=0.8)
    for row, n in enumerate(lengths):
        expected = _gae_loop(rewards[row].tolist(), values[row].tolist(), n, 0.9, 0.8)
        assert advantages[row, :n].tolist() == pytest.approx(expected, abs=1e-5)
        assert advantages[row, n:].abs().sum() == 0 and returns[row, n:].abs().sum() == 0
    torch.testing.assert_close(returns * mask, (advantages + values) * mask)
