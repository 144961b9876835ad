"""A pipeline's statistics as a table and as a funnel plot: documents and text left after each stage."""

from __future__ import annotations

from pathlib import Path

from lmlab.curation.document import StageStats


def _top_drops(s: StageStats, n: int = 3) -> str:
    return ", ".join(f"{rule} {count:,}" for rule, count in s.dropped.most_common(n))


def funnel_table(stats: dict[str, StageStats]) -> str:
    """A Markdown table: per stage, documents in and out, the share kept, MB out, edits and the main drop rules."""
    lines = ["| stage | docs in | docs out | kept | MB out | edited | main drops |", "|---|---:|---:|---:|---:|---:|---|"]
    for label, s in stats.items():
        kept = f"{s.docs_out / s.docs_in:.1%}" if s.docs_in else "-"
        lines.append(f"| {label} | {s.docs_in:,} | {s.docs_out:,} | {kept} | {s.bytes_out / 1e6:.2f} | {s.edited:,} | "
                     f"{_top_drops(s)} |")
    return "\n".join(lines)


def plot_funnel(stats: dict[str, StageStats], path: Path, title: str = "") -> Path:
    """Two panels: documents and MB of text after each stage, each bar labelled with the share of the stage's input
    it kept and its main drop rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(stats)
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.55 * len(labels) + 1.6), sharey=True)
    panels = ((axes[0], [(s.docs_out, s.docs_in) for s in stats.values()], 1, "documents"),
              (axes[1], [(s.bytes_out, s.bytes_in) for s in stats.values()], 1e6, "MB of text"))
    for ax, pairs, scale, unit in panels:
        bars = ax.barh(range(len(labels)), [out / scale for out, _ in pairs], color="tab:blue")
        ax.set_xlabel(f"{unit} out")
        ax.set_xlim(0, max([out / scale for out, _ in pairs] + [1e-9]) * 1.45)
        for bar, (out, into), s in zip(bars, pairs, stats.values()):
            top = s.dropped.most_common(1)
            note = (f"{out / into:.0%} kept" if into else "") + (f"; {top[0][0]}" if top and unit == "documents" else "")
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + note, va="center", fontsize=8)
    axes[0].set_yticks(range(len(labels)), labels)
    axes[0].invert_yaxis()
    fig.suptitle(title or "pipeline funnel")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
