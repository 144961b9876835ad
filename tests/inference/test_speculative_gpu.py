"""On CUDA: greedy speculative decoding with a draft model, each round replayed as one CUDA graph (engines
compiled or not, the draft's one-token steps in the decode megakernel or not, a ring-buffer draft), gives
the target's own greedy output in float32."""

import copy

import pytest
import torch

from lmlab.inference.engine import Engine
from lmlab.inference.speculative import speculative_generate
from lmlab.nn import ModelConfig, Transformer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 9, 2, 40, 41], [7, 1, 3, 3, 8, 20, 11, 60, 2], [4]]
GQA = {"name": "mha", "n_heads": 4, "n_kv_heads": 2}


def _model(n_layers: int = 2, attention=None) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=128, n_layers=n_layers, max_seq_len=96, norm="rmsnorm", ffn="swiglu",
                      position="rope", attention=attention or GQA, block="prenorm")
    return Transformer(cfg, vocab_size=128).cuda().eval()


def _noisy_copy(model: Transformer) -> Transformer:
    draft = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.3 * p.std().nan_to_num(0))
    return draft


@pytest.mark.parametrize(("compile", "megakernel", "attention"), [
    (False, False, GQA), (True, False, GQA), (True, True, GQA),
    (False, False, {"name": "mha", "n_heads": 4, "window": 6}),
])
def test_graphed_rounds_give_the_targets_greedy_output(compile, megakernel, attention):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(attention=attention)
    reference = Engine(model, attention_kernel=False)
    target = Engine(model, compile=compile, cuda_graphs=True)
    draft = Engine(_noisy_copy(model), compile=compile, cuda_graphs=True, megakernel=megakernel)
    rates = []
    for prompt in PROMPTS:
        expected = reference.generate([prompt], max_new_tokens=30).tokens[0]
        out = speculative_generate(target, draft, prompt, k=3, max_new_tokens=30)
        assert out.tokens[0] == expected
        rates.append(out.extra["acceptance_rate"])
    assert draft.drafted_rounds.graph is not None  # the rounds ran as a captured graph
    assert 0 < min(rates) and max(rates) < 1
