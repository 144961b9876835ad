#!/usr/bin/env bash
# Copies run.sh's small results (evaluations, each run's train.log and metrics.csv) from OUT_DIR to DEST,
# leaving checkpoints and data behind, and packs them into DEST.tgz: one file, as the device tool
# returns a limited number of files per call.
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
tar czf "$DEST.tgz" -C "$(dirname "$DEST")" "$(basename "$DEST")"
