#!/usr/bin/env bash
# How run.sh's parts ran on the lent H200 (the device tool: one command of at most 10 minutes, results in $OUT).
# It installs Hydra's wheels carried in .whl/ (the image lacks hydra-core and omegaconf), runs PARTS of run.sh
# into outputs/ab2 (train and qat side by side when both are asked for), stops them at LIMIT seconds and packs
# the small results into $OUT/ab2.tgz. Launched again on the still-warm machine, finished runs are skipped and
# interrupted ones continue from their checkpoints.
#   LIMIT=540 PARTS="corpus train qat" bash experiments/architecture-ablations-2/h200-driver.sh
set -uo pipefail
start=$(date +%s); LIMIT=${LIMIT:-540}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/bin
for s in "lmlab main" "lmlab-train train" "lmlab-tokenize tokenize"; do set -- $s
  printf '#!/bin/sh\nexec python3 -c "import sys; from lmlab.cli.%s import main; sys.exit(main())" "$@"\n' $2 > /tmp/bin/$1
  chmod +x /tmp/bin/$1; done
export PATH=/tmp/bin:$PATH OMP_NUM_THREADS=2
D=$PWD/outputs/ab2; mkdir -p $D
R=experiments/architecture-ablations-2/run.sh
left() { echo $((start + LIMIT - $(date +%s))); }
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
PARTS=${PARTS:-corpus train qat}
if [[ " $PARTS " == *" corpus "* ]] && ! ls $D/cache/*.json >/dev/null 2>&1; then
  timeout $(left) bash $R $D corpus > $D/corpus.log 2>&1; echo "corpus rc $? at $(( $(date +%s) - start )) s"
  grep -E "MB from|tokens" $D/corpus.log | tr '\r' '\n' | tail -2
fi
for part in train qat; do
  [[ " $PARTS " == *" $part "* ]] && ( timeout $(left) bash $R $D $part > $D/$part.log 2>&1; echo "$part rc $? at $(( $(date +%s) - start )) s" ) &
done
n=0
while [ "$(jobs -rp | wc -l)" -gt 0 ]; do
  sleep 5; n=$((n+1)); [ $((n % 12)) = 0 ] && echo "t=$(( $(date +%s) - start ))s finished: $(ls $D/runs/*/checkpoints/last.ckpt 2>/dev/null | wc -l) gpu: $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader)"
done
wait
if [[ " $PARTS " == *" bench "* ]]; then
  timeout $(left) bash $R $D bench > $D/bench.log 2>&1; echo "bench rc $? at $(( $(date +%s) - start )) s"
fi
for f in $D/runs/*.log; do echo "$(basename $f): $(grep -o 'val/loss [0-9.]* -> [0-9.]*.*tokens/s' $f | tail -n 1)"; done
tail -n 8 $D/qat.log 2>/dev/null; tail -n 12 $D/bench.log 2>/dev/null
cd outputs && tar czf $OUT/ab2.tgz --exclude=cache --exclude=corpus --exclude='*.ckpt' --exclude='*.bin' ab2 && ls -la $OUT
