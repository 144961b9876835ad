#!/usr/bin/env bash
# Architecture ablations, second round (issue 24): mixers beyond softmax attention at (about) equal
# parameter count, on the same data, steps and seed, in parts that each fit one device-tool call:
#   corpus  the scaling-laws corpus (source files of the machine, never repeated at these step counts;
#           experiments/scaling-laws/run.sh corpus: $MB MB, a BPE of $VOCAB tokens) and its token cache
#   train   every variant below, $PARALLEL at a time (they share the GPU, so their logged tokens/s are not
#           a speed measurement); csv logs, final val/loss
#   qat     qat.py on the gqa variant: trained plain, with qat=int4 and with qat=int4 +head, then int4 PTQ
#           (round-to-nearest and GPTQ) of each; validation loss before and after
#   bench   each variant alone: `lmlab bench train` (median training step, eager and compiled) and
#           `lmlab bench generate` on its trained checkpoint (decode tokens/s at batch 1 and 32, the eager
#           step replayed from a CUDA graph); then report.py writes the table and plots
# Env: MB (120), VOCAB (4096), CONTEXT (512), BATCH (32), STEPS (2000), PARALLEL (7), LR (2e-3),
#      SMALL=1 (a CPU-sized check of the pipeline: tiny corpus, model and steps).
# Usage: experiments/architecture-ablations-2/run.sh OUT_DIR [corpus train qat bench]
set -euo pipefail
D=${1:?usage: run.sh OUT_DIR [corpus train qat bench]}
shift
PARTS=${*:-corpus train qat bench}
HERE=$(cd "$(dirname "$0")" && pwd)
for part in $PARTS; do
    case $part in corpus|train|qat|bench) ;; *) echo "unknown part '$part'" >&2; exit 2 ;; esac
done
if [ "${SMALL:-0}" = 1 ]; then
    MB=${MB:-2}; VOCAB=${VOCAB:-512}; CONTEXT=${CONTEXT:-64}; BATCH=${BATCH:-8}; STEPS=${STEPS:-20}
    SIZE=${SIZE:-"model.d_model=128 model.n_layers=4"}; BENCH=${BENCH:-"--batch 1 --prompt 16 --new 16"}
fi
MB=${MB:-120}; VOCAB=${VOCAB:-4096}; CONTEXT=${CONTEXT:-512}; BATCH=${BATCH:-32}; STEPS=${STEPS:-2000}
PARALLEL=${PARALLEL:-7}; LR=${LR:-2e-3}
SIZE=${SIZE:-"model.d_model=512 model.n_layers=8"}; BENCH=${BENCH:-"--batch 1 32 --prompt 128 --new 256"}
LMLAB="python -m lmlab.cli.main"  # runs from a checkout without installing, as on the GPU machine
TOKENIZER=$D/tokenizer
DATA="data=text_files data.paths=[$D/corpus/corpus.jsonl] data.context_length=$CONTEXT tokenizer.path=$TOKENIZER
      cache_dir=$D/cache data.batch_size=$BATCH model.max_seq_len=$CONTEXT $SIZE"
TRAIN="trainer.max_steps=$STEPS trainer.val_every=$((STEPS / 10)) optim.lr=$LR sched.warmup_steps=$((STEPS / 20))
       trainer.progress_bar=false logger=csv seed=0"

# name | overrides. GQA (8 query heads, 2 K/V heads) is the reference; each other row is sized to within
# 5% of its parameters (report.py prints them), except looped_half, which keeps GQA's FLOPs per token.
GQA="model.attention.n_heads=8 model.attention.n_kv_heads=2"
MAMBA="model.attention.n_heads=8 model.attention.expand=1 model.attention.d_state=64 model.attention.chunk_size=64"
mkdir -p "$D/runs" "$D/bench"
# SIGTERM (a time limit) reaches the runs, which save a checkpoint to continue from; so work runs in the background
trap 'kill -TERM $(jobs -p) 2>/dev/null; wait; exit 143' TERM
cat > "$D/variants.txt" <<EOF
gqa|$GQA
mamba2|model/attention=mamba2 $MAMBA
gated_deltanet|model/attention=gated_deltanet model.attention.n_heads=4 model.attention.head_dim=64 model.attention.chunk_size=64
hybrid_3to1|$GQA model.layer_pattern=[mamba2,mamba2,mamba2,mha] +model.mixers.mamba2={n_heads:8,expand:1,d_state:64,chunk_size:64}
cla|$GQA model.kv_share=2
looped|$GQA model.loops=2
looped_half|$GQA model.n_layers=4 model.loops=2
EOF

variants() { grep -v '^#' "$D/variants.txt"; }
train_one() {  # NAME OVERRIDE...: one run, logged to runs/NAME.log; a second launch continues it
    local name=$1; shift
    python -m lmlab.cli.train $DATA $TRAIN "$@" ckpt_path=auto hydra.run.dir="$D/runs/$name" > "$D/runs/$name.log" 2>&1 \
        || echo "failed: $name (see $D/runs/$name.log)" >&2
}
for part in $PARTS; do
    echo "== $part -> $D" >&2
    case $part in
        corpus)
            MB=$MB VOCAB=$VOCAB CONTEXT=$CONTEXT bash "$HERE/../scaling-laws/run.sh" "$D" corpus ;;
        train)
            while IFS='|' read -r name overrides; do
                while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do sleep 1; done
                train_one "$name" $overrides &
            done < <(variants)
            wait ;;
        qat)
            python "$HERE/qat.py" --steps "$STEPS" --out "$D/qat" $DATA $TRAIN $GQA > "$D/qat.txt" 2>&1 &
            wait $! || echo "qat failed (see $D/qat.txt)" >&2
            tail -n 6 "$D/qat.txt" ;;
        bench)
            while IFS='|' read -r name overrides; do
                echo "-- $name" >&2
                $LMLAB bench train $DATA $overrides --variants reference,reference+compile --steps 10 \
                    --json "$D/bench/$name-train.json" > "$D/bench/$name-train.txt" 2>&1 || echo "bench train failed: $name" >&2
                $LMLAB bench generate --ckpt "$D/runs/$name/checkpoints/last.ckpt" --engines graphs $BENCH \
                    --json "$D/bench/$name-generate.json" > "$D/bench/$name-generate.txt" 2>&1 \
                    || echo "bench generate failed: $name" >&2
            done < <(variants)
            python "$HERE/report.py" "$D" ;;
    esac
done
