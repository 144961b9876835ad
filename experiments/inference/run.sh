#!/usr/bin/env bash
# The inference issue's GPU measurements on one GPU, in parts that each fit one device-tool call:
#   tests  the CUDA-only engine and quantization tests
#   bench  lmlab bench generate on the ~400M config (random weights, vocab 50304, bf16): lmlab
#          compiled (CUDA graphs) and Hugging Face generate at batch 1, 8, 32, 128 with a 128-token
#          prompt and 256 new tokens, then lmlab eager at batch 1
#   quant  the compiled engine at batch 1 on int8 and int4 (group 64) copies of the same weights
# Usage: experiments/inference/run.sh OUT_DIR [tests|bench|quant ...]   (all parts by default)
set -euo pipefail
D=${1:?usage: run.sh OUT_DIR [tests|bench|quant ...]}
shift
PARTS=${*:-tests bench quant}
mkdir -p "$D"
LMLAB="python -m lmlab.cli.main"  # runs from a checkout without installing, as on the GPU machine
B="$LMLAB bench generate model=llama400m model.vocab_size=50304 --prompt 128 --new 256 --repeats 1"
for part in $PARTS; do
    echo "== $part -> $D" >&2
    case $part in
        tests) python -m pytest -q -m gpu tests/inference -p no:cacheprovider 2>&1 | tail -15 | tee "$D/gpu-tests.txt" ;;
        bench) $B --engines compiled,hf --batch 1 8 32 128 --json "$D/bench.json" --plot "$D/decode_tokens_per_s.png" \
                   2>&1 | grep -v -i warn | tee "$D/bench.txt"
               $B --engines eager --batch 1 --json "$D/bench-eager.json" 2>&1 | grep -v -i warn | tail -3 \
                   | tee "$D/bench-eager.txt" ;;
        quant) $B --engines compiled --batch 1 --quant int8 int4 --json "$D/bench-quant.json" 2>&1 \
                   | grep -v -i warn | tail -8 | tee "$D/bench-quant.txt" ;;
        *) echo "unknown part '$part'; parts: tests bench quant" >&2; exit 2 ;;
    esac
done
