#!/usr/bin/env bash
# The scaling-laws experiment, in parts that each fit a device-tool call (a warm machine keeps $D):
#   corpus    make_corpus.py: Python source of the machine's stdlib and packages ($MB MB), and a BPE of
#             $VOCAB tokens trained on its first $SAMPLE_MB MB
#   isoflop   lmlab scaling sweep at $BUDGETS ($SIZES sizes each), launched; collect; fit every method
#   predict   plan the compute-optimal run at 10x the largest budget from the IsoFLOP fit, train it, and
#             compare its final val/loss with the prediction
#   mup       learning-rate sweep at widths 128..1024 under model/init=gpt2 (standard) and mup
#   batch     batch-size sweep at fixed tokens with the gradient noise scale logged
# Env: BUDGETS ("[1e14,3e14,1e15]"), SIZES (5), MB (100), SAMPLE_MB (10), VOCAB (4096), CONTEXT (256),
#      BATCH (32), PARALLEL (sweep runs side by side, 1; small models leave an H200 idle: try 8),
#      SMALL=1 (a CPU-sized corpus, budgets and sweeps, to check the pipeline).
# Usage: experiments/scaling-laws/run.sh OUT_DIR [corpus isoflop predict mup batch]
set -euo pipefail
D=${1:?usage: run.sh OUT_DIR [corpus isoflop predict mup batch]}
shift
PARTS=${*:-corpus isoflop predict mup batch}
HERE=$(dirname "$0")
for part in $PARTS; do
    case $part in corpus|isoflop|predict|mup|batch) ;; *) echo "unknown part '$part'" >&2; exit 2 ;; esac
done
if [ "${SMALL:-0}" = 1 ]; then
    MB=${MB:-2}; SAMPLE_MB=${SAMPLE_MB:-1}; VOCAB=${VOCAB:-512}; BUDGETS=${BUDGETS:-"[1e12,2e12,4e12]"}; SIZES=${SIZES:-5}
    CONTEXT=${CONTEXT:-64}; BATCH=${BATCH:-32}; WIDTHS=${WIDTHS:-64,128}; LRS=${LRS:-1e-3,1e-2}; MUP_STEPS=${MUP_STEPS:-20}
    BATCHES=${BATCHES:-8,16}; BATCH_TOKENS=${BATCH_TOKENS:-40960}
fi
MB=${MB:-100}; SAMPLE_MB=${SAMPLE_MB:-10}; VOCAB=${VOCAB:-4096}; BUDGETS=${BUDGETS:-"[1e14,3e14,1e15]"}; SIZES=${SIZES:-5}
CONTEXT=${CONTEXT:-256}; BATCH=${BATCH:-32}; WIDTHS=${WIDTHS:-128,256,512,1024}; LRS=${LRS:-3e-4,1e-3,3e-3,1e-2,3e-2}
MUP_STEPS=${MUP_STEPS:-500}; BATCHES=${BATCHES:-8,16,32,64,128,256}; BATCH_TOKENS=${BATCH_TOKENS:-20000000}
PARALLEL=${PARALLEL:-1}
TOKENIZER=$D/tokenizer
CORPUS="data=text_files data.paths=[$D/corpus/corpus.txt] data.context_length=$CONTEXT tokenizer.path=$TOKENIZER
        cache_dir=$D/cache"  # what the token cache is keyed by
DATA="$CORPUS data.batch_size=$BATCH model.max_seq_len=$CONTEXT trainer.progress_bar=false logger=csv"
mkdir -p "$D"
for part in $PARTS; do
    echo "== $part -> $D" >&2
    case $part in
        corpus)
            python "$HERE/make_corpus.py" "$D/corpus" --mb "$MB" --sample-mb "$SAMPLE_MB"
            lmlab-tokenize train data=text_files "data.paths=[$D/corpus/sample.txt]" tokenizer.vocab_size=$VOCAB \
                hydra.run.dir=$TOKENIZER
            lmlab-tokenize encode $CORPUS ;;
        isoflop)
            lmlab scaling sweep "budgets=$BUDGETS" n_sizes=$SIZES out=$D/sweep launch=true parallel=$PARALLEL $DATA
            lmlab scaling collect "$D/sweep" --budgets "$(echo "$BUDGETS" | tr -d '[]')" --out "$D/points.csv"
            lmlab scaling fit "$D/points.csv" --out "$D/fit" ;;
        predict)
            largest=$(echo "$BUDGETS" | tr -d '[]' | tr ',' '\n' | sort -g | tail -1)
            flops=$(python -c "print(f'{10 * $largest:.3g}')")
            lmlab scaling plan "flops=$flops" "fit=$D/fit/fits.json" method=isoflop $DATA | tee "$D/predict-plan.txt"
            cmd=$(grep -m1 '^  lmlab-train ' "$D/predict-plan.txt")
            $cmd $DATA hydra.run.dir=$D/predict 2>&1 | tail -1
            lmlab scaling collect "$D/predict" --out "$D/predict-points.csv"
            python - "$D/fit/fits.json" "$D/predict-points.csv" "$flops" <<'EOF'
import csv, json, sys
fits, rows, flops = json.load(open(sys.argv[1])), list(csv.DictReader(open(sys.argv[2]))), float(sys.argv[3])
from lmlab.scaling.laws import law_from_json
measured = float(rows[-1]["loss"])
for name, entry in fits.items():
    if "law" in entry:
        predicted = float(law_from_json(entry["law"]).predicted_loss(flops))
        print(f"{name}: predicted {predicted:.4f}, measured {measured:.4f}, error {100 * (predicted / measured - 1):+.2f}%")
EOF
            ;;
        mup)
            lmlab-train -m $DATA "model.d_model=$WIDTHS" "optim.lr=$LRS" model/init=gpt2,mup \
                trainer.max_steps=$MUP_STEPS hydra.sweep.dir=$D/mup
            python "$HERE/plot_sweeps.py" mup "$D/mup" ;;
        batch)
            # the same tokens at every batch size: steps = BATCH_TOKENS / (batch x context)
            for b in ${BATCHES//,/ }; do
                lmlab-train $DATA data.batch_size=$b trainer.max_steps=$((BATCH_TOKENS / (b * CONTEXT))) \
                    trainer.val_every=$((BATCH_TOKENS / (b * CONTEXT) / 20 > 0 ? BATCH_TOKENS / (b * CONTEXT) / 20 : 1)) \
                    trainer.accumulate_grad_batches=2 trainer.grad_noise_scale=true hydra.run.dir=$D/batch/$b 2>&1 | tail -1
            done
            python "$HERE/plot_sweeps.py" batch "$D/batch" ;;
    esac
done
