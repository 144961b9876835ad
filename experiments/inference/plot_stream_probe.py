"""Bar chart of stream_gemv_probe.py's variants: each one's median time a chain, bf16 and int8 side by side, against
the weights' copy bound.

    python experiments/inference/plot_stream_probe.py OUT.png PROBE.json [PROBE.json ...] [--chunk-kb 16] [--warps 4]

Rows of the chosen chunk size and warp count are drawn; where several files time the same variant, the last one
given wins, so list older runs first.
"""

from __future__ import annotations

import argparse
import json

from matplotlib.figure import Figure  # renders with Agg, no display needed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("probes", nargs="+")
    parser.add_argument("--chunk-kb", type=int, default=16)
    parser.add_argument("--warps", type=int, default=4)
    args = parser.parse_args()
    times, bounds, device = {}, {}, None
    for path in args.probes:
        with open(path) as f:
            probe = json.load(f)
        device = probe["device"]
        for row in probe["rows"]:
            if row["chunk_bytes"] == args.chunk_kb * 1024 and row.get("warps", 4) == args.warps:
                times.setdefault(row["dtype"], {})[row["variant"]] = row["us"]
                bounds[row["dtype"]] = row["weight_bytes"] / probe["copy_bandwidth"] * 1e6
    if not times:
        raise SystemExit(f"no rows with {args.chunk_kb} KB chunks and {args.warps} warps in {args.probes}")
    fig = Figure(figsize=(11, 4.5))
    for ax, (dtype, rows) in zip(fig.subplots(1, len(times), sharey=False, squeeze=False)[0], sorted(times.items())):
        names = sorted(rows, key=rows.get)
        ax.barh(names, [rows[n] for n in names], color="tab:blue")
        ax.axvline(bounds[dtype], color="tab:red", linestyle="--", label=f"copy bound {bounds[dtype]:.0f} us")
        for y, name in enumerate(names):
            ax.text(rows[name], y, f" {rows[name]:.0f}", va="center", fontsize=8)
        ax.set(title=dtype, xlabel="us a chain (24 layers, 96 stages)")
        ax.tick_params(axis="y", labelsize=8)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{device}: llama400m's matrix-vector chain, {args.chunk_kb} KB chunks, {args.warps} compute warps",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()
