#!/usr/bin/env bash
# Copies run.sh's small results (evaluations, each run's train.log and metrics.csv, the DPO pairs' count)
# from OUT_DIR to DEST, leaving checkpoints and data behind: what the device tool brings back.
set -euo pipefail
D=${1:?usage: collect.sh OUT_DIR DEST}; DEST=${2:?usage: collect.sh OUT_DIR DEST}
mkdir -p "$DEST/eval"
cp "$D"/eval/*.json "$DEST/eval/" 2>/dev/null || true
for run in "$D"/*/; do
    name=$(basename "$run")
    [ -f "$run/train.log" ] && cp "$run/train.log" "$DEST/$name.log"
    csv=$(find "$run" -name metrics.csv | head -1)
    [ -n "$csv" ] && cp "$csv" "$DEST/$name.csv"
done
true
