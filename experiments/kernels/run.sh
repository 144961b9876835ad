#!/usr/bin/env bash
# The kernel issue's GPU work on one GPU, in parts that each fit one device-tool call (10 min):
#   tests   the CUDA-only kernel tests; with pytest-xdist installed, 8 workers, so Triton's compiles
#           and autotuning (most of their time) run side by side
#   kernels lmlab bench kernels: every kernel against its references, table + JSON
#   train   lmlab bench train on the ~400M config: the compiled reference against the kernel
#           variants, with profiles and lmlab-train's own tokens/s
# Usage: experiments/kernels/run.sh OUT_DIR [tests|kernels|train ...]   (all parts by default)
set -euo pipefail
D=${1:?usage: run.sh OUT_DIR [tests|kernels|train ...]}
shift
PARTS=${*:-tests kernels train}
mkdir -p "$D"
LMLAB="python -m lmlab.cli.main"  # runs from a checkout without installing, as on the GPU machine
M="model=llama400m tokenizer=byte model.vocab_size=50304 data.context_length=2048 data.batch_size=16"
VARIANTS=${VARIANTS:-reference+compile,triton+compile,triton-attention-rms_norm-swiglu+compile}
for part in $PARTS; do
    echo "== $part -> $D" >&2
    case $part in
        tests)
            workers=$(python -c "import importlib.util as u; print('-n 8' if u.find_spec('xdist') else '')")
            python -m pytest -q -m gpu tests/kernels tests/nn/test_moe_gpu.py $workers -p no:cacheprovider \
                2>&1 | tail -30 | tee "$D/gpu-tests.txt" ;;
        kernels) $LMLAB bench kernels --json "$D/kernels.json" | tee "$D/kernels.txt" ;;
        train) $LMLAB bench train $M --variants "$VARIANTS" --steps 8 --warmup 3 --lmlab-train \
                   --profile "$D/profiles" --json "$D/train-400m.json" | tee "$D/train-400m.txt"
               # One profile table per variant, renamed without '+': the device tool returns only
               # files with plain names.
               for f in "$D"/profiles/*+*; do mv "$f" "${f//+/_}"; done ;;
        *) echo "unknown part '$part'; parts: tests kernels train" >&2; exit 2 ;;
    esac
done
