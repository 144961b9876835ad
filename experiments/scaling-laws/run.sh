#!/usr/bin/env bash
# The scaling-laws experiment, in parts that each fit a device-tool call (a warm machine keeps $D):
#   corpus    make_corpus.py: source files of the machine's stdlib, packages and /usr/include ($MB MB), a BPE of
#             $VOCAB tokens trained on its first $SAMPLE_MB MB, and the token cache every run reads
#   isoflop   lmlab scaling sweep at $BUDGETS ($SIZES sizes each), launched; collect; fit every method
#   predict   plan the compute-optimal run at 10x the largest budget from the $METHOD fit, train it, and
#             compare its final val/loss with the prediction
#   mup       learning-rate sweep at widths 128..1024 under model/init=gpt2 (standard) and mup
#   batch     batch-size sweep at fixed tokens with the gradient noise scale logged
# The mup and batch runs, like the sweep's, train $PARALLEL at a time.
# Env: BUDGETS ("[1e14,3e14,1e15]"), SIZES (5), MB (400), SAMPLE_MB (10), VOCAB (4096), CONTEXT (256),
#      BATCH (32), PARALLEL (sweep runs side by side, 1; small models leave an H200 idle: try 8),
#      HEAD_DIM (64; the sweep's and the plan's widths are its multiples: 32 gives small models finer steps),
#      SHAPE (more shape rules for the sweep and the plan alike, e.g. "aspect=32 aspect_tolerance=1.3": one family of
#      shapes, depth growing with width),
#      METHOD (isoflop: the fit whose N* the prediction run trains),
#      TRAIN (more lmlab-train overrides for every run, e.g. "trainer.compile=true trainer.cuda_graphs=true": small
#      models' steps replayed from CUDA graphs),
#      SWEEP (more `lmlab scaling sweep` settings, e.g. "spread=3 fit=FITS.json method=joint": sizes placed by an
#      earlier fit instead of Chinchilla's law), SMALL=1 (a CPU-sized corpus, budgets and sweeps, to check the pipeline).
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
MB=${MB:-400}; SAMPLE_MB=${SAMPLE_MB:-10}; VOCAB=${VOCAB:-4096}; BUDGETS=${BUDGETS:-"[1e14,3e14,1e15]"}; SIZES=${SIZES:-5}
CONTEXT=${CONTEXT:-256}; BATCH=${BATCH:-32}; WIDTHS=${WIDTHS:-128,256,512,1024}; LRS=${LRS:-1e-4,3e-4,1e-3,3e-3,1e-2,3e-2}
MUP_STEPS=${MUP_STEPS:-500}; BATCHES=${BATCHES:-8,16,32,64,128,256}; BATCH_TOKENS=${BATCH_TOKENS:-20000000}
PARALLEL=${PARALLEL:-1}; SWEEP=${SWEEP:-}; SHAPE=${SHAPE:-}; HEAD_DIM=${HEAD_DIM:-64}; METHOD=${METHOD:-isoflop}
largest=$(echo "$BUDGETS" | tr -d '[]' | tr ',' '\n' | sort -g | tail -1)
PREDICT_FLOPS=$(python -c "print(f'{10 * $largest:.3g}')")  # the prediction run's budget: 10x the largest
TOKENIZER=$D/tokenizer
CORPUS="data=text_files data.paths=[$D/corpus/corpus.jsonl] data.context_length=$CONTEXT tokenizer.path=$TOKENIZER
        cache_dir=$D/cache"  # what the token cache is keyed by
DATA="$CORPUS data.batch_size=$BATCH model.max_seq_len=$CONTEXT trainer.progress_bar=false logger=csv ${TRAIN:-}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # parallel runs share the CPU cores
mkdir -p "$D"
export DATA
# stdin: "RUN_DIR OVERRIDE..." a line; lmlab-train runs, $PARALLEL at a time, each logged to RUN_DIR.log. A failed
# run is reported and the others go on: in a learning-rate sweep the largest rates are expected to diverge. A second
# launch skips finished runs and continues interrupted ones (ckpt_path=auto).
side_by_side() {
    xargs -L1 -P "$PARALLEL" bash -c 'mkdir -p "$(dirname "$0")"; lmlab-train $DATA "${@}" ckpt_path=auto "hydra.run.dir=$0" > "$0.log" 2>&1 \
        || echo "failed: $0 (see $0.log)" >&2'
}
for part in $PARTS; do
    echo "== $part -> $D" >&2
    case $part in
        corpus)
            python "$HERE/make_corpus.py" "$D/corpus" --mb "$MB" --sample-mb "$SAMPLE_MB"
            lmlab-tokenize train data=text_files "data.paths=[$D/corpus/sample.jsonl]" tokenizer.vocab_size=$VOCAB \
                hydra.run.dir=$TOKENIZER
            lmlab-tokenize encode $CORPUS ;;
        isoflop)
            lmlab scaling sweep "budgets=$BUDGETS" n_sizes=$SIZES out=$D/sweep launch=true parallel=$PARALLEL head_dim=$HEAD_DIM $SHAPE $SWEEP $DATA
            lmlab scaling collect "$D/sweep" --budgets "$(echo "$BUDGETS" | tr -d '[]')" --out "$D/points.csv"
            lmlab scaling fit "$D/points.csv" --at "$PREDICT_FLOPS" --out "$D/fit" ;;
        predict)
            lmlab scaling plan "flops=$PREDICT_FLOPS" "fit=$D/fit/fits.json" method=$METHOD head_dim=$HEAD_DIM $SHAPE $DATA | tee "$D/predict-plan.txt"
            cmd=$(grep -m1 '^  lmlab-train ' "$D/predict-plan.txt")
            $cmd $DATA ckpt_path=auto hydra.run.dir=$D/predict 2>&1 | tail -1  # a second launch continues it
            lmlab scaling collect "$D/predict" --out "$D/predict-points.csv"
            python - "$D/fit/fits.json" "$D/predict-points.csv" <<'EOF'
import csv, json, sys
fits, rows = json.load(open(sys.argv[1])), list(csv.DictReader(open(sys.argv[2])))
measured = float(rows[-1]["loss"])
for name, entry in fits.items():  # every method's prediction at the run's budget, fitted before the run
    low_high = entry.get("predicted_loss_interval")
    band = f" [{low_high[0]:.4f}, {low_high[1]:.4f}]" if low_high else ""
    print(f"{name}: predicted {entry['predicted_loss']:.4f}{band} at {entry['at']:.3g} FLOPs, measured "
          f"{measured:.4f}, error {100 * (entry['predicted_loss'] / measured - 1):+.2f}%")
EOF
            ;;
        mup)
            for init in gpt2 mup; do for width in ${WIDTHS//,/ }; do for lr in ${LRS//,/ }; do
                echo "$D/mup/$init-$width-$lr model/init=$init model.d_model=$width optim.lr=$lr trainer.max_steps=$MUP_STEPS"
            done; done; done | side_by_side
            python "$HERE/plot_sweeps.py" mup "$D/mup" ;;
        batch)
            # the same tokens at every batch size: steps = BATCH_TOKENS / (batch x context), about 20 validations
            for b in ${BATCHES//,/ }; do
                steps=$((BATCH_TOKENS / (b * CONTEXT)))
                echo "$D/batch/$b data.batch_size=$b trainer.max_steps=$steps trainer.val_every=$((steps / 20 > 0 ? steps / 20 : 1))" \
                    "trainer.accumulate_grad_batches=2 trainer.grad_noise_scale=true"
            done | side_by_side
            python "$HERE/plot_sweeps.py" batch "$D/batch" ;;
    esac
done
