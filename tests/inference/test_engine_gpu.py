"""On CUDA: the graph-replayed decode step, compiled or not and with the flash-decoding kernel,
computes what the eager engine with SDPA computes, for the cache kinds (full, ring buffer, latent,
recurrent), and whole generations agree; an MoE
model generates with graphs too (or falls back to the compiled step without them)."""

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


@pytest.mark.parametrize("compile", [True, False])
@pytest.mark.parametrize("attention", [{"name": "mha", "n_heads": 4, "n_kv_heads": 2},
                                       {"name": "mha", "n_heads": 4, "window": 8}, "mla", "linear"])
def test_graph_replayed_decode_matches_eager(attention, compile):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(attention)
    eager = Engine(model, attention_kernel=False)
    replayed = Engine(model, compile=compile, cuda_graphs=True)
    assert replayed.cuda_graphs and replayed.attention_kernel is not None
    for engine in (eager, replayed):
        engine.begin(3, 40, torch.tensor([4, 0, 8], device="cuda"))
        engine.extend(torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(0)).cuda())
    assert all(step.graph is not None for step in replayed._steps.values())  # captured, not fallen back
    for step in range(12):
        token = torch.tensor([step, 2 * step, 3 * step], device="cuda")
        torch.testing.assert_close(replayed.decode(token), eager.decode(token), atol=1e-4, rtol=1e-4)
    assert eager.generate(PROMPTS, max_new_tokens=30).tokens == replayed.generate(PROMPTS, max_new_tokens=30).tokens
    for prompt in PROMPTS:  # one sequence: greedy steps in blocks of sync_every (greedy_steps)
        alone = [engine.generate([prompt], max_new_tokens=30).tokens for engine in (eager, replayed)]
        assert alone[0] == alone[1]
        assert replayed.greedy_steps.graphs.keys() == {16, 13}  # 29 decode steps: a block of 16, then one of 13
        assert all(graph is not None for graph in replayed.greedy_steps.graphs.values())  # replayed as graphs


def test_moe_model_generates_with_graphs_requested():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, n_layers=2, max_seq_len=96, norm="rmsnorm", ffn="swiglu", position="rope",
                      attention={"name": "mha", "n_heads": 4}, block="prenorm",
                      moe={"name": "topk", "n_experts": 4, "k": 2})
    model = Transformer(cfg, vocab_size=128).cuda().eval()
    expected = Engine(model).generate(PROMPTS, max_new_tokens=10).tokens
    assert Engine(model, cuda_graphs=True).generate(PROMPTS, max_new_tokens=10).tokens == expected
