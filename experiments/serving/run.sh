#!/usr/bin/env bash
# The serving issue's GPU measurements on one GPU, in one device-tool call (Hydra carried as wheels in .whl/):
#   tests   the CUDA-only serving tests and the paged decode kernel's tests
#   kernel  lmlab bench paged-attention: the paged kernel against the contiguous flash-decoding kernel
#   sched   lmlab bench serve on llama400m (random weights, bf16): continuous against static batching over
#           Poisson arrival rates, mixed (ShareGPT-like) prompt and output lengths
#   prefix  the same with a shared 1,000-token system prompt: prefix caching on against off
# Env: REQUESTS (128), RATES ("8 16 32 64 inf"), SLO (p99 TTFT bound in s, 1.0), BLOCKS (16384).
# Each part stops at its own time limit (TESTS_S, SCHED_S, PREFIX_S), so one slow part leaves the others time.
# Usage: experiments/serving/run.sh OUT_DIR [kernel sched prefix tests]
set -uo pipefail
D=${1:?usage: run.sh OUT_DIR [tests kernel sched prefix]}
shift
PARTS=${*:-kernel sched prefix tests}
mkdir -p "$D"
if ! python -c "import hydra" 2>/dev/null; then  # the device image lacks Hydra: its wheels travel in .whl/
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
LMLAB="python -m lmlab.cli.main"
MODEL="model=llama400m model.vocab_size=50304"
COMMON="--requests ${REQUESTS:-128} --num-blocks ${BLOCKS:-16384}"
for part in $PARTS; do
    echo "== $part -> $D ($(date +%T))" >&2
    case $part in
        tests) timeout ${TESTS_S:-120} python -m pytest -q -m gpu tests/serving tests/kernels/test_paged_decode_attention_triton.py \
                   -p no:cacheprovider 2>&1 | tail -15 | tee "$D/gpu-tests.txt" ;;
        kernel) timeout 60 $LMLAB bench paged-attention --json "$D/paged-attention.json" 2>&1 | tee "$D/paged-attention.txt" ;;
        sched) timeout ${SCHED_S:-240} $LMLAB bench serve $MODEL $COMMON --rates ${RATES:-8 16 32 64 inf} --ttft-slo ${SLO:-1.0} \
                   --json "$D/sched.json" --plot "$D/ttft_vs_rate.png" 2>&1 | grep -v -i warn | tee "$D/sched.txt" ;;
        prefix) timeout ${PREFIX_S:-120} $LMLAB bench serve $MODEL $COMMON --shared-prefix 1000 --prompt-mean 128 --output-mean 128 \
                    --rates 16 inf --json "$D/prefix.json" 2>&1 | grep -v -i warn | tee "$D/prefix.txt" ;;
        *) echo "unknown part '$part'; parts: tests kernel sched prefix" >&2; exit 2 ;;
    esac
done
