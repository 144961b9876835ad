"""On CUDA: the paged runner's decode path (Triton paged kernel, CUDA graphs per padded batch) gives the
logits of the portable path (gather + SDPA, eager), and the serving engine's greedy outputs do not change
with it; `lmlab bench paged-attention` runs."""

import json

import pytest
import torch

from lmlab.cli.main import main
from lmlab.nn import ModelConfig, Transformer
from lmlab.serving import SamplingParams, ServingConfig, ServingEngine
from lmlab.serving.blocks import BlockTable
from lmlab.serving.runner import PagedRunner, Row

pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=128, n_layers=2, max_seq_len=256, norm="rmsnorm", ffn="swiglu", position="rope",
                      block="prenorm", attention={"name": "mha", "n_heads": 4, "n_kv_heads": 2})
    return Transformer(cfg, vocab_size=512).cuda().eval()


def test_decode_kernel_and_graphs_match_the_portable_path():
    model = _model()
    fast = PagedRunner(model, 64, 16, attention_kernel=True, cuda_graphs=True)
    slow = PagedRunner(model, 64, 16, attention_kernel=False, cuda_graphs=False)
    tables = [BlockTable([5, 9, 2]), BlockTable([7]), BlockTable([11, 3])]
    lengths = [40, 9, 20]
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 512, (n + 1,), generator=g).tolist() for n in lengths]
    for runner in (fast, slow):  # the prompts, then one decode step of the three
        runner.forward([Row(s[:n], 0, t) for s, n, t in zip(ids, lengths, tables)])
    rows = [Row(s[n:n + 1], n, t) for s, n, t in zip(ids, lengths, tables)]
    torch.testing.assert_close(fast.forward(rows), slow.forward(rows), atol=1e-4, rtol=1e-4)
    assert 4 in fast._graphs  # three rows padded to a captured batch of four


def test_greedy_outputs_do_not_depend_on_the_decode_path():
    model = _model()
    prompts = [list(range(i, i + n)) for i, n in enumerate((5, 33, 17, 60))]
    outs = []
    for fast in (True, False):
        engine = ServingEngine(model, None, ServingConfig(attention_kernel=fast, cuda_graphs=fast, num_blocks=128))
        outs.append([c[0].token_ids for c in engine.generate(prompts, SamplingParams(max_tokens=24))])
    assert outs[0] == outs[1]


def test_paged_attention_bench_runs(tmp_path):
    out = tmp_path / "paged.json"
    assert main(["bench", "paged-attention", "--batch", "1", "32", "--context", "384", "--repeats", "5",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 32] and all(r["paged_us"] > 0 for r in rows)
