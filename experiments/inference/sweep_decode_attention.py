"""The flash-decoding kernel's launch settings, timed as a decode step meets it: each layer's cache cold in L2.

    python experiments/inference/sweep_decode_attention.py --batch 1 8 32 --fill 256

The first sweep of these settings (h200-2026-12-01/kbench.txt) replayed one call on one 384-slot cache, whose
filled keys and values (33.5 MB at batch 32) stay largely in the H200's 50 MB L2 between replays. In a decode
step each layer reads its own cache once, from DRAM. Here a CUDA graph runs the call once for each of llama400m's
24 layers, on 24 caches (16 heads of 64, bf16, `fill` slots filled, this step's keys and values rotated with RoPE
and appended, as the engine calls it), and reports microseconds per call (medians of 20 replays) and the rate at
which the filled keys and values are read, for each setting of keys per block, warps, pipeline stages and splits
of the key range.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from lmlab.kernels import decode_attention_triton as dat
from lmlab.timing import graph_replay_us

LAYERS, HEADS, HEAD_DIM, CACHE = 24, 16, 64, 384
SETTINGS = {"BLOCK_N": (32, 64, 128), "NUM_WARPS": (2, 4, 8), "NUM_STAGES": (2, 3, 4), "splits": (1, 2, 4)}


def calls(batch: int, fill: int):
    """One appending decode_attention call per layer, as a function of nothing."""
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    caches = [(make(batch, HEADS, CACHE, HEAD_DIM), make(batch, HEADS, CACHE, HEAD_DIM)) for _ in range(LAYERS)]
    q, k, v = (make(batch, HEADS, 1, HEAD_DIM) for _ in range(3))
    slots = torch.tensor([fill], device="cuda")
    start = torch.zeros(batch, dtype=torch.long, device="cuda")
    angles = torch.arange(CACHE, device="cuda")[:, None] * 10000 ** (-torch.arange(HEAD_DIM // 2, device="cuda") / 32)
    rotary = (angles.cos().contiguous(), angles.sin().contiguous(), False)

    def run():
        for kc, vc in caches:
            dat.decode_attention(q, kc, vc, slots, start, new_keys=k, new_values=v, rotary=rotary)
    return run


def us_per_call(run) -> float:
    return graph_replay_us(run, replays=20, warmup_calls=2) / LAYERS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--fill", type=int, default=256)
    args = parser.parse_args()
    default = {name: getattr(dat, name) for name in SETTINGS if name != "splits"}
    choose = dat.n_splits
    for batch in args.batch:
        run = calls(batch, args.fill)
        kv_bytes = 2 * batch * HEADS * args.fill * HEAD_DIM * 2
        dat.n_splits = choose
        base = us_per_call(run)
        print(f"batch {batch}, fill {args.fill}: module settings {base:.2f} us a call "
              f"({kv_bytes / base / 1e3:,.0f} GB/s of keys and values; {choose(batch * HEADS, CACHE, 'cuda')} splits)",
              flush=True)
        results = []
        for values in itertools.product(*SETTINGS.values()):
            setting = dict(zip(SETTINGS, values))
            for name, value in setting.items():
                if name != "splits":
                    setattr(dat, name, value)
            dat.n_splits = lambda *_, n=setting["splits"]: n
            try:
                results.append((us_per_call(run), setting))
            except Exception as err:  # a setting that does not fit (shared memory, registers)
                print(f"  {setting}: {type(err).__name__}", flush=True)
        for us, setting in sorted(results, key=lambda r: r[0])[:6]:
            print(f"  {us:6.2f} us ({kv_bytes / us / 1e3:,.0f} GB/s): {setting}", flush=True)
        for name, value in default.items():
            setattr(dat, name, value)
        dat.n_splits = choose
        del run
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
