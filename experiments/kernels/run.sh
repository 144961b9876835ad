#!/usr/bin/env bash
# The kernel issue's GPU work on one GPU, in parts that each fit one device-tool call (10 min):
#   tests   the CUDA-only kernel tests; with pytest-xdist installed, 8 workers, so Triton's compiles
#           and autotuning (most of their time) run side by side
#   kernels lmlab bench kernels: every kernel against its references, table + JSON
#   train   lmlab bench train on the ~400M config: the compiled reference against the kernel
#           variants, with profiles and lmlab-train's own tokens/s
#   fp8     lmlab bench train on the ~1.4B config (d_model 2048, 24 layers, 16 heads of 128), 8 x 2048
#           tokens per step: bf16 against fp8 tensorwise and rowwise, compiled (FP8_VARIANTS)
#   graphs  lmlab bench train on the ~400M config: the best compiled variant (BEST) per block against the whole
#           step replayed from CUDA graphs (`+graphs`)
#   graphs14  the ~1.4B config at B14_BATCH (16) x 2048 tokens: BEST+graphs (the whole step compiled and replayed from CUDA
#           graphs), then BEST, each in a process of its own (two resident variants fill an H200 here)
#   recompute  activation recomputation (recompute=selective, full) against none: the ~400M step, then the ~1.4B step
#           at B14_BATCH (16) x 2048 tokens with BEST and BEST+recompute-selective (two resident variants), then
#           BEST+recompute-full alone at twice that batch
#   b16     the ~1.4B config at 16 x 2048 tokens per step: BEST against BEST with fp8=B16_FP8 (tensorwise; profiles),
#           then the compiled reference alone in a process of its own (two resident variants fill an H200 here)
#   attention  the attention probes: the tile settings of the Hopper path's Gluon forward, dQ and dK/dV kernels
#           (FlashAttention-3's overlap of the softmax with the tensor cores) against the portable Triton kernels
#           and cuDNN, then each pass apart
#   gluon-bwd  the Hopper attention's GPU tests, the backward probe (the fused dK/dV/dQ kernel among its rows) at
#           the issue's two shapes and the ~400M step's, `lmlab bench kernels --only attention` (forward+backward
#           against SDPA), then the forward probe
#   attention-train  the ~400M step (16 x 2048) and the ~1.4B step (B14_BATCH x 2048) with BEST (cuDNN's attention)
#           against BEST's kernels with lmlab's attention (ATTN_VARIANT: the Gluon kernels on Hopper)
#   ncu     Nsight Compute's full counter set for one launch of each attention pass (ncu_attention.py: cuDNN's and the
#           Gluon kernels' at the issue's two shapes): the details page, the raw metrics and the SASS with its stall
#           samples, the last two gzipped (the reports stay on the machine)
#   fp8-loss  lmlab-train of the ~1.4B config on tinyshakespeare (CORPUS, bytes) for FP8_STEPS steps, each fp8
#           entry of FP8_RECIPES (none tensorwise rowwise) in turn: the validation loss after the same tokens
#   compute  trainer.compute_dtype=bfloat16 (the forward and backward on bf16 copies of the float32 weights) against the
#           float32 weights under autocast: the ~400M step (BEST, BEST+compute-bfloat16 and COMPUTE_ATTN, lmlab's
#           attention, +compute-bfloat16; profiles), then the ~1.4B step at B14_BATCH (16) x 2048, each in its own process
#   compute-loss  as fp8-loss, for trainer.compute_dtype=null and bfloat16, COMPUTE_STEPS (150) steps
#   bf16-true  trainer.precision=bf16-true (bf16 weights, gradients and Adam moments, rounded stochastically) against
#           the float32 weights under autocast and trainer.compute_dtype=bfloat16: the ~400M step (BEST and both; profiles),
#           then the ~1.4B step at B14_BATCH (16) x 2048, each variant in its own process
#   bf16-loss  as fp8-loss for each of BF16_RECIPES: mixed (trainer.precision=bf16-mixed, float32 weights), true
#           (bf16-true), nearest (bf16-true rounding to nearest: optim.stochastic_rounding=false) and moments (bf16-true,
#           Adam's moments in float32: optim.state_dtype=float32), BF16_STEPS (300) steps; BF16_RECIPES defaults to the
#           first three
#   bf16-best  bf16-true with the other step-time levers on the ~400M step: BEST and ATTN_VARIANT (lmlab's attention),
#           then BEST+graphs (the whole step from CUDA graphs) in its own process
#   bf16-best14  the same on the ~1.4B step at B14_BATCH (16) x 2048: BEST and ATTN_VARIANT, each in its own process
# fp8 needs torchao: carry its wheel. Env: B14_BATCH, CORPUS (outputs/data/tinyshakespeare.txt), FP8_STEPS (300), FP8_RECIPES, B16_FP8,
# COMPUTE_ATTN, COMPUTE_STEPS, BF16_RECIPES, BF16_STEPS, LOSS_MODEL (the loss parts' model overrides; the ~1.4B config).
# Usage: experiments/kernels/run.sh OUT_DIR [tests|kernels|train|graphs|graphs14|recompute|attention|gluon-bwd|attention-train|ncu|fp8|b16|fp8-loss|compute|compute-loss|bf16-true|bf16-loss|bf16-best|bf16-best14 ...]   (tests kernels train by default)
set -euo pipefail
D=${1:?usage: run.sh OUT_DIR [tests|kernels|train ...]}
shift
PARTS=${*:-tests kernels train}
mkdir -p "$D"
LMLAB="python -m lmlab.cli.main"  # runs from a checkout without installing, as on the GPU machine
M="model=llama400m tokenizer=byte model.vocab_size=50304 data.context_length=2048 data.batch_size=16"
VARIANTS=${VARIANTS:-reference+compile,triton+compile,triton-attention-rms_norm-swiglu+compile}
B14="model=llama400m model.d_model=2048 model.attention.n_heads=16 data.context_length=2048"
B14_BENCH="$B14 tokenizer=byte model.vocab_size=50304"  # the bench's ~1.4B step: byte tokens, vocabulary 50304
BEST=${BEST:-triton-attention-rms_norm-swiglu+compile}
# Three at most: the bench keeps every variant's model and AdamW state (~23 GB each at 1.4B) resident
FP8_VARIANTS=${FP8_VARIANTS:-reference+compile,reference+compile+fp8-tensorwise,reference+compile+fp8-rowwise}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1 || true)
ncu_pages() {  # REPORT PREFIX: PREFIX-details.txt, PREFIX-raw.csv.gz, PREFIX-sass.csv.gz (a page that fails is left out)
    "$NCU" -i "$1" --page details > "$2-details.txt" || true
    "$NCU" -i "$1" --page raw --csv | gzip > "$2-raw.csv.gz" || true
    "$NCU" -i "$1" --page source --csv --print-source sass | gzip > "$2-sass.csv.gz" || true
}
loss_run() {  # NAME STEPS OVERRIDE...: lmlab-train of LOSS_MODEL (the ~1.4B config) on CORPUS (bytes), its validation loss at the end
    local name=$1 steps=$2
    shift 2
    python -m lmlab.cli.train ${LOSS_MODEL:-$B14} data=text_files "data.paths=[${CORPUS:-outputs/data/tinyshakespeare.txt}]" \
        tokenizer=byte data.context_length=1024 data.batch_size=8 trainer.compile=true "$@" \
        trainer.max_steps=$steps trainer.val_every=$steps trainer.val_batches=20 \
        trainer.progress_bar=false trainer.checkpoint_every=100000 cache_dir="$D/cache" \
        hydra.run.dir="$D/$name" 2>&1 | grep -v -i warn | tail -3 | tee "$D/$name.txt"
}
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
        fp8) $LMLAB bench train $B14_BENCH data.batch_size=8 --variants "$FP8_VARIANTS" \
                 --steps 6 --warmup 3 --json "$D/train-1.4b-fp8.json" | tee "$D/train-1.4b-fp8.txt" ;;
        b16) $LMLAB bench train $B14_BENCH data.batch_size=16 \
                 --variants "$BEST,$BEST+fp8-${B16_FP8:-tensorwise}" --steps 6 --warmup 3 --profile "$D/profiles-1.4b-b16" \
                 --json "$D/train-1.4b-b16.json" | tee "$D/train-1.4b-b16.txt"
             for f in "$D"/profiles-1.4b-b16/*+*; do mv "$f" "${f//+/_}"; done
             $LMLAB bench train $B14_BENCH data.batch_size=16 \
                 --variants reference+compile --steps 6 --warmup 3 \
                 --json "$D/train-1.4b-b16-reference.json" | tee "$D/train-1.4b-b16-reference.txt" ;;
        graphs) $LMLAB bench train $M --variants "$BEST,$BEST+graphs" --steps 8 --warmup 3 \
                    --json "$D/train-400m-graphs.json" | tee "$D/train-400m-graphs.txt" ;;
        graphs14)
            for v in "$BEST+graphs" "$BEST"; do
                $LMLAB bench train $B14_BENCH data.batch_size=${B14_BATCH:-16} --variants "$v" --steps 6 --warmup 3 \
                    --json "$D/train-1.4b-b${B14_BATCH:-16}-${v//+/_}.json" | tee "$D/train-1.4b-b${B14_BATCH:-16}-${v//+/_}.txt"
            done ;;
        recompute)
            $LMLAB bench train $M --variants "$BEST,$BEST+recompute-selective,$BEST+recompute-full" --steps 8 --warmup 3 \
                --json "$D/train-400m-recompute.json" | tee "$D/train-400m-recompute.txt"
            $LMLAB bench train $B14_BENCH data.batch_size=${B14_BATCH:-16} --variants "$BEST,$BEST+recompute-selective" \
                --steps 6 --warmup 3 --json "$D/train-1.4b-recompute.json" | tee "$D/train-1.4b-recompute.txt"
            # twice the batch, which needs recomputation to fit: full recompute alone in its process
            $LMLAB bench train $B14_BENCH data.batch_size=$((2 * ${B14_BATCH:-16})) --variants "$BEST+recompute-full" \
                --steps 4 --warmup 2 --json "$D/train-1.4b-recompute-2x.json" | tee "$D/train-1.4b-recompute-2x.txt" ;;
        attention)
            # a kernel that hangs must not take the whole call with it
            timeout 200 python experiments/kernels/attention_gluon_probe.py --json "$D/attention-gluon-probe.json" \
                | tee "$D/attention-gluon-probe.txt" || true
            timeout 240 python experiments/kernels/attention_gluon_bwd_probe.py \
                --json "$D/attention-gluon-bwd-probe.json" | tee "$D/attention-gluon-bwd-probe.txt" || true
            python experiments/kernels/attention_passes_probe.py --json "$D/attention-passes.json" \
                | tee "$D/attention-passes.txt" ;;
        gluon-bwd)
            workers=$(python -c "import importlib.util as u; print('-n 8' if u.find_spec('xdist') else '')")
            timeout 150 python -m pytest -q -m gpu tests/kernels/test_flash_gluon.py $workers -p no:cacheprovider \
                2>&1 | tail -25 | tee "$D/gpu-tests-gluon.txt" || true
            timeout 180 python experiments/kernels/attention_gluon_bwd_probe.py \
                --shapes 1,16,16384,64 4,16,4096,128 16,16,2048,64 \
                --json "$D/attention-gluon-bwd-probe.json" | tee "$D/attention-gluon-bwd-probe.txt" || true
            timeout 90 $LMLAB bench kernels --only attention --json "$D/kernels-attention.json" \
                | tee "$D/kernels-attention.txt" || true
            timeout 90 python experiments/kernels/attention_gluon_probe.py --json "$D/attention-gluon-probe.json" \
                | tee "$D/attention-gluon-probe.txt" ;;
        attention-train)
            A=${ATTN_VARIANT:-triton-rms_norm-swiglu+compile}
            $LMLAB bench train $M --variants "$BEST,$A" --steps 8 --warmup 3 --json "$D/train-400m-attention.json" \
                | tee "$D/train-400m-attention.txt"
            $LMLAB bench train $B14_BENCH data.batch_size=${B14_BATCH:-8} --variants "$BEST,$A" --steps 6 --warmup 3 \
                --json "$D/train-1.4b-attention.json" | tee "$D/train-1.4b-attention.txt" ;;
        ncu)
            timeout 420 "$NCU" --clock-control none --profile-from-start off --set full -f -o /tmp/ncu-attention \
                python experiments/kernels/ncu_attention.py 2>&1 | tail -12 || true
            ncu_pages /tmp/ncu-attention.ncu-rep "$D/ncu-attention" ;;
        fp8-loss)
            for recipe in ${FP8_RECIPES:-none tensorwise rowwise}; do
                loss_run "fp8-loss-$recipe" ${FP8_STEPS:-300} fp8=$recipe
            done ;;
        compute)
            $LMLAB bench train $M --variants "$BEST,$BEST+compute-bfloat16,${COMPUTE_ATTN:-triton-rms_norm-swiglu+compile}+compute-bfloat16" \
                --steps 8 --warmup 3 --profile "$D/profiles-compute" --json "$D/train-400m-compute.json" \
                | tee "$D/train-400m-compute.txt"
            for f in "$D"/profiles-compute/*+*; do mv "$f" "${f//+/_}"; done
            for v in "$BEST+compute-bfloat16" "$BEST"; do
                $LMLAB bench train $B14_BENCH data.batch_size=${B14_BATCH:-16} --variants "$v" --steps 6 --warmup 3 \
                    --json "$D/train-1.4b-b${B14_BATCH:-16}-${v//+/_}.json" | tee "$D/train-1.4b-b${B14_BATCH:-16}-${v//+/_}.txt"
            done ;;
        compute-loss)
            for dtype in null bfloat16; do
                loss_run "compute-loss-$dtype" ${COMPUTE_STEPS:-150} trainer.compute_dtype=$dtype
            done ;;
        bf16-true)
            $LMLAB bench train $M --variants "$BEST,$BEST+compute-bfloat16,$BEST+bf16-true" --steps 8 --warmup 3 \
                --profile "$D/profiles-bf16-true" --json "$D/train-400m-bf16-true.json" | tee "$D/train-400m-bf16-true.txt"
            for f in "$D"/profiles-bf16-true/*+*; do mv "$f" "${f//+/_}"; done
            for v in "$BEST+bf16-true" "$BEST+compute-bfloat16" "$BEST"; do
                $LMLAB bench train $B14_BENCH data.batch_size=${B14_BATCH:-16} --variants "$v" --steps 6 --warmup 3 \
                    --json "$D/train-1.4b-b${B14_BATCH:-16}-${v//+/_}.json" | tee "$D/train-1.4b-b${B14_BATCH:-16}-${v//+/_}.txt"
            done ;;
        bf16-loss)
            declare -A recipes=([mixed]="trainer.precision=bf16-mixed" [true]="trainer.precision=bf16-true"
                                [nearest]="trainer.precision=bf16-true optim.stochastic_rounding=false"
                                [moments]="trainer.precision=bf16-true optim.state_dtype=float32")
            for recipe in ${BF16_RECIPES:-mixed true nearest}; do
                loss_run "bf16-loss-$recipe" ${BF16_STEPS:-300} ${recipes[$recipe]}
            done ;;
        bf16-best)
            A=${ATTN_VARIANT:-triton-rms_norm-swiglu+compile}
            $LMLAB bench train $M --variants "$BEST+bf16-true,$A+bf16-true" --steps 8 --warmup 3 \
                --json "$D/train-400m-bf16-attention.json" | tee "$D/train-400m-bf16-attention.txt"
            $LMLAB bench train $M --variants "$BEST+bf16-true+graphs" --steps 8 --warmup 3 \
                --json "$D/train-400m-bf16-graphs.json" | tee "$D/train-400m-bf16-graphs.txt" ;;
        bf16-best14)
            A=${ATTN_VARIANT:-triton-rms_norm-swiglu+compile}
            for v in "$BEST+bf16-true" "$A+bf16-true"; do
                $LMLAB bench train $B14_BENCH data.batch_size=${B14_BATCH:-16} --variants "$v" --steps 6 --warmup 3 \
                    --json "$D/train-1.4b-b${B14_BATCH:-16}-${v//+/_}.json" | tee "$D/train-1.4b-b${B14_BATCH:-16}-${v//+/_}.txt"
            done ;;
        *) echo "unknown part '$part'; parts: tests kernels train graphs graphs14 recompute attention gluon-bwd attention-train ncu fp8 b16 fp8-loss compute compute-loss bf16-true bf16-loss bf16-best bf16-best14" >&2; exit 2 ;;
    esac
done
