#!/usr/bin/env bash
# Issue 18's figures: `lmlab eval` on MMLU (5-shot, log-likelihood), GSM8K (5-shot, greedy) and the
# checkpoint's own validation perplexity, with the real data in ../shared/data/eval (not shipped).
# Usage: experiments/eval/run.sh CKPT OUT_DIR [LIMIT [OVERRIDES...]]
#        (LIMIT: questions per MMLU subject, GSM8K problems, context blocks of validation text; null: all)
set -euo pipefail
CKPT=${1:?usage: run.sh CKPT OUT_DIR [LIMIT]}
OUT=${2:?usage: run.sh CKPT OUT_DIR [LIMIT]}
LIMIT=${3:-null}
shift $(( $# < 3 ? $# : 3 ))
DATA=${EVAL_DATA:-../shared/data/eval}
python -m lmlab.cli.main eval ckpt="$CKPT" out="$OUT" "eval=[perplexity,mmlu,gsm8k]" eval.limit="$LIMIT" \
    eval.mmlu.path="$DATA/mmlu" eval.gsm8k.path="$DATA/gsm8k" "$@" 2>&1 | grep -v "it/s]\|q/s]\|ex/s]" | tee "$OUT.log"
