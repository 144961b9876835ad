"""Summaries of Nsight Compute's pages as `run.sh ... ncu` writes them (gzipped CSV), without Nsight's GUI.

    python experiments/ncu_summary.py stalls RAW.csv.gz             # per kernel: time, tensor pipe, warp stall shares
    python experiments/ncu_summary.py ops SASS.csv.gz KERNEL [N]     # the N-th launch named KERNEL: opcode mix
    python experiments/ncu_summary.py hot SASS.csv.gz KERNEL [N]     # ... its most stalled SASS lines, with reasons

RAW is `ncu -i REPORT --page raw --csv`; SASS is `ncu -i REPORT --page source --csv --print-source sass`, which
holds one section per profiled launch, each headed by its kernel's name. Stall shares come from the warp state
sampling (`smsp__pcsamp_warps_issue_stalled_*`): where the warps were when sampled, issuing or waiting on what.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip

STALL = "smsp__pcsamp_warps_issue_stalled_"


def _lines(path: str) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def stalls(path: str) -> None:
    rows = [r for r in csv.reader(_lines(path)) if r]
    header = rows[0]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith(STALL) and not h.endswith("_not_issued")]
    units: list[str] = []
    for row in rows:  # reports appended one after another each repeat the header, then a row of units
        if row == header or len(row) != len(header):
            continue
        if not units or row[col["Kernel Name"]] == "":
            units = row
            continue

        def num(name: str) -> float:
            return float(row[col[name]].replace(",", "") or 0)

        total = sum(num(r) for r in reasons) or 1
        shares = sorted(((num(r) / total, r[len(STALL):]) for r in reasons), reverse=True)
        tensor = num("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")
        time_unit = units[col["gpu__time_duration.sum"]]
        print(f"{row[col['Kernel Name']][:60]:60} {num('gpu__time_duration.sum'):9.3f} {time_unit}  tensor pipe "
              f"{tensor:5.1f}%  {num('smsp__inst_executed.sum') / 1e6:8.1f}M warp instructions")
        print("    " + "  ".join(f"{name} {share * 100:.1f}%" for share, name in shares if share >= 0.02))


def _section(path: str, kernel: str, occurrence: int) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the occurrence-th launch whose kernel name contains `kernel`."""
    sections, current = [], None
    for line in _lines(path):
        if line.startswith('"Kernel Name"'):
            current = (line, [])
            sections.append(current)
        elif current is not None:
            current[1].append(line)
    matching = [rows for name, rows in sections if kernel in name]
    if occurrence >= len(matching):
        raise SystemExit(f"ncu_summary: {len(matching)} launches of {kernel!r} in {path}")
    rows = list(csv.reader(matching[occurrence]))
    return rows[0], rows[1:]


def _opcode(sass: str) -> str:
    words = sass.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def ops(path: str, kernel: str, occurrence: int) -> None:
    header, rows = _section(path, kernel, occurrence)
    executed, sampled = header.index("Instructions Executed"), header.index("Warp Stall Sampling (All Samples)")
    count, stall = collections.Counter(), collections.Counter()
    for row in rows:
        count[_opcode(row[1])] += int(row[executed] or 0)
        stall[_opcode(row[1])] += int(row[sampled] or 0)
    total, samples = sum(count.values()), sum(stall.values()) or 1
    print(f"{kernel}: {total / 1e6:.1f}M warp instructions executed")
    for op, n in count.most_common(25):
        print(f"  {op:12} {n / total * 100:5.1f}% of instructions  {stall[op] / samples * 100:5.1f}% of stall samples")


def hot(path: str, kernel: str, occurrence: int, lines: int = 25) -> None:
    header, rows = _section(path, kernel, occurrence)
    sampled = header.index("Warp Stall Sampling (All Samples)")
    reasons = [i for i, h in enumerate(header) if h.startswith("stall_") and not h.endswith("(Not Issued)")]
    total = sum(int(r[sampled] or 0) for r in rows) or 1
    top = sorted(range(len(rows)), key=lambda i: -int(rows[i][sampled] or 0))[:lines]
    for i in sorted(top):
        row = rows[i]
        why = max(reasons, key=lambda j: int(row[j] or 0))
        print(f"{i:6} {int(row[sampled]) / total * 100:5.1f}%  {header[why][6:]:14} {row[1].strip()[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("stalls", "ops", "hot"))
    parser.add_argument("path")
    parser.add_argument("kernel", nargs="?", default="")
    parser.add_argument("occurrence", nargs="?", type=int, default=0)
    args = parser.parse_args()
    if args.what == "stalls":
        stalls(args.path)
    else:
        (ops if args.what == "ops" else hot)(args.path, args.kernel, args.occurrence)


if __name__ == "__main__":
    main()
