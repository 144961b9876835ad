"""On CUDA: the compiled, graph-captured decode step computes what the eager engine computes, for
the cache kinds (full, ring buffer, latent, recurrent), and whole generations agree."""

import pytest
import torch

from lmlab.inference.engine import Engine
from lmlab.nn import ModelConfig, Transformer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 9, 2, 40, 41], [7, 1, 3, 3, 8, 20, 11, 60, 2], [4]]


def _model(attention) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, n_layers=2, max_seq_len=96, norm="rmsnorm", ffn="swiglu", position="rope",
                      attention=attention, block="prenorm")
    return Transformer(cfg, vocab_size=128).cuda().eval()


@pytest.mark.parametrize("attention", [{"name": "mha", "n_heads": 4, "n_kv_heads": 2},
                                       {"name": "mha", "n_heads": 4, "window": 8}, "mla", "linear"])
def test_compiled_graph_decode_matches_eager(attention):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(attention)
    eager, compiled = Engine(model), Engine(model, compile=True)
    assert compiled.cuda_graphs
    for engine in (eager, compiled):
        engine.begin(3, 40, torch.tensor([4, 0, 8], device="cuda"))
        engine.extend(torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(0)).cuda())
    for step in range(12):
        token = torch.tensor([step, 2 * step, 3 * step], device="cuda")
        torch.testing.assert_close(compiled.decode(token), eager.decode(token), atol=1e-4, rtol=1e-4)
    assert eager.generate(PROMPTS, max_new_tokens=30).tokens == compiled.generate(PROMPTS, max_new_tokens=30).tokens
