#!/usr/bin/env bash
# How run.sh's parts ran on the lent H200 (the device tool: one command of at most 10 minutes, results in $OUT).
# It installs Hydra's wheels carried in .whl/ (the image lacks hydra-core and omegaconf), puts lmlab's console
# scripts on PATH, builds the corpus once per machine, runs two lanes of parts side by side (LANE_A, LANE_B
# with PB runs at a time), stops them at LIMIT seconds and packs the small results into $OUT/sl.tgz. Launched
# again on the still-warm machine, it skips the corpus, and the parts continue where they stopped.
#   LIMIT=545 MB=300 BUDGETS="[1e13,3e13,1e14]" LANE_A=isoflop LANE_B=batch bash experiments/scaling-laws/h200-driver.sh
set -uo pipefail
start=$(date +%s); LIMIT=${LIMIT:-560}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/bin
for s in "lmlab main" "lmlab-train train" "lmlab-compare compare" "lmlab-tokenize tokenize"; do set -- $s
  printf '#!/bin/sh\nexec python3 -c "import sys; from lmlab.cli.%s import main; sys.exit(main())" "$@"\n' $2 > /tmp/bin/$1
  chmod +x /tmp/bin/$1; done
export PATH=/tmp/bin:$PATH
D=$PWD/outputs/sl; mkdir -p $D; export PARALLEL=${PARALLEL:-8}
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader; nproc; python3 --version
left() { echo $((start + LIMIT - $(date +%s))); }
R=experiments/scaling-laws/run.sh
t0=$(date +%s)
if ! ls $D/cache/*.json >/dev/null 2>&1; then
  MB=${MB:-600} bash $R $D corpus > $D/corpus.log 2>&1 || { tail -3 $D/corpus.log; MB=${MB2:-300} bash $R $D corpus > $D/corpus.log 2>&1; }
fi
grep -E "MB from|tokens \(|trained" $D/corpus.log | tr '\r' '\n' | tail -3; echo "corpus: $(( $(date +%s) - t0 )) s"
( timeout $(left) bash $R $D ${LANE_A:-isoflop predict} > $D/laneA.log 2>&1; echo "lane A rc $? at $(( $(date +%s) - start )) s" ) &
( [ -n "${LANE_B-mup batch}" ] && PARALLEL=${PB:-4} timeout $(left) bash $R $D ${LANE_B-mup batch} > $D/laneB.log 2>&1; echo "lane B rc $? at $(( $(date +%s) - start )) s" ) &
n=0
while [ "$(jobs -rp | wc -l)" -gt 0 ] && [ "$(left)" -gt -20 ]; do
  sleep 5; n=$((n+1)); [ $((n % 6)) = 0 ] && echo "t=$(( $(date +%s) - start ))s runs done: $(ls $D/sweep/isoflop/*/*/checkpoints/last.ckpt $D/mup/*/checkpoints/last.ckpt $D/batch/*/checkpoints/last.ckpt 2>/dev/null | wc -l) gpu: $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader)"
done
wait
tail -5 $D/laneA.log; tail -5 $D/laneB.log
cd outputs && tar czf $OUT/sl.tgz --exclude=cache --exclude=corpus --exclude='*.ckpt' --exclude='*.bin' sl && ls -la $OUT
