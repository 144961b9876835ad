"""Forward + backward of the fused output projection + cross-entropy at several (row, vocabulary) tile sizes.

At the bench's shape (32768 x 1024 hidden, vocabulary 50304, bf16 leaves): `linear_cross_entropy` at each
`(chunk_size, vocab_chunk_size)` against F.linear + lmlab's cross-entropy compiled, which holds the whole logits.
Medians with L2 emptied (`lmlab.kernels.bench.median_seconds`), and the memory each call holds above its inputs.

    python experiments/kernels/linear_ce_tiles.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from lmlab.kernels.bench import median_seconds, peak_bytes
from lmlab.kernels.chunked_cross_entropy import linear_cross_entropy
from lmlab.training.losses import cross_entropy

TILES = [(2048, 8192), (4096, 16384), (8192, 16384)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    n, d, v = 32768, 1024, 50304
    hidden = torch.randn(n, d, device=dev, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, d, device=dev, dtype=torch.bfloat16) * d ** -0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), device=dev)

    def step(loss_fn):
        def run():
            return torch.autograd.grad(loss_fn(), (hidden, weight))
        return run

    reference = torch.compile(lambda: cross_entropy(F.linear(hidden, weight), targets, -100, 0.0, False)[0])
    candidates = {"F.linear + cross-entropy, compiled": step(reference)}
    for chunk, vocab_chunk in TILES:
        candidates[f"fused, tiles {chunk} x {vocab_chunk}"] = step(
            lambda chunk=chunk, vocab_chunk=vocab_chunk: linear_cross_entropy(
                hidden, weight, targets, chunk_size=chunk, vocab_chunk_size=vocab_chunk)[0])
    expected = candidates["F.linear + cross-entropy, compiled"]()
    rows = []
    for name, fn in candidates.items():
        err = max((g.float() - e.float()).abs().max().item() for g, e in zip(fn(), expected))
        seconds = median_seconds(fn, args.repeats, 2, dev)
        peak = peak_bytes(fn, dev)
        rows.append({"impl": name, "ms": seconds * 1e3, "peak_mib": peak / 2**20, "max_abs_grad_err": err})
        print(f"{name:40} {seconds * 1e3:8.2f} ms  {peak / 2**20:8.0f} MiB  grad err {err:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
