"""Packed documents: positions (batch, seq) that restart at 0 give each document its own attention, so a
packed row's logits equal each document's run alone, for every attention entry that declares a document
mask and every position scheme; the others refuse packed positions with one clear error."""

from __future__ import annotations

import pytest
import torch

from lmlab.nn import ModelConfig, Transformer
from lmlab.nn.attention import ATTENTION
from lmlab.nn.positions import POSITIONS

SETTINGS = {"mha": {"n_heads": 4}, "mla": {"n_heads": 4}, "linear": {"n_heads": 4}}


def _model(attention: str, position: str, **attn) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=2, max_seq_len=32, norm="rmsnorm", ffn="swiglu", block="prenorm",
                      position=position, attention={"name": attention, **SETTINGS.get(attention, {}), **attn})
    return Transformer(cfg, vocab_size=100).eval()


def _packed(model: Transformer, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    docs = [torch.randint(0, 100, (1, n)) for n in lengths]
    ids = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        return model(ids, positions), torch.cat([model(d) for d in docs], dim=1)


@pytest.mark.parametrize("attention", ATTENTION.names())
@pytest.mark.parametrize("position", POSITIONS.names())
def test_packed_documents_attend_only_within_themselves(attention, position):
    try:
        model = _model(attention, position)
    except Exception as err:  # a combination the model refuses (ALiBi with MLA or linear attention)
        pytest.skip(f"{attention} with {position}: {err}")
    if not getattr(model.layers[0].self_attn, "supports_documents", False):
        with pytest.raises(ValueError, match="need an attention with a document mask"):
            _packed(model, [5, 7])
        return
    packed, alone = _packed(model, [5, 7, 3])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_a_sliding_window_applies_within_each_document():
    packed, alone = _packed(_model("mha", "rope", window=3), [6, 8])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_positions_must_match_the_ids():
    model = _model("mha", "rope")
    with pytest.raises(ValueError, match=r"positions \(1, 4\) must match input_ids \(1, 5\)"):
        model(torch.zeros(1, 5, dtype=torch.long), torch.arange(4)[None])
