#!/usr/bin/env bash
# The inference issue's GPU measurements on one GPU, in parts that each fit one device-tool call:
#   tests  the CUDA-only engine and quantization tests
#   bench  lmlab bench generate on the ~400M config (random weights, vocab 50304, bf16): lmlab
#          compiled (CUDA graphs) and Hugging Face generate at batch 1, 8, 32, 128 with a 128-token
#          prompt and 256 new tokens, then lmlab eager at batch 1
#   quant  the compiled engine and the megakernel at batch 1 on the weights and on int8 and int4 (group 64) copies
#   quant-ab  the megakernel at batch 1 on bf16, int8 and int4 (group 64 for llama400m) copies in turns in one process, one step
#          of each profiled (ab_megakernel_steps.py)
#   ncu    Nsight Compute's full counter set for one launch of the megakernel's layer stack at batch 1, on bf16
#          and on int8 weights (ncu_megakernel.py, a process each): the details page and the raw
#          metrics of both, and the bf16 stack's SASS with its stall samples (gzipped)
#   megakernel  the decode megakernel's GPU tests (and the flash-decoding and normed-head kernels', which share its
#          loop and its code conversion), then the bench at batch 1, 8 and 32: the megakernel, its stages launched
#          one by one, and lmlab compiled
#   train  target then draft:
#   target a llama400m on tinyshakespeare (CORPUS=path), BPE vocab 8192 in a 50304-row embedding, into
#          $D/target; a folder holding a checkpoint resumes from it (ckpt_path=auto), so a run longer
#          than one call spans two on the same warm machine: TRAIN_SECONDS stops the first with SIGTERM
#          (the run saves checkpoints/last.ckpt) and the same command without it finishes the run
#   draft  a ~4x smaller draft (d_model 768, 4 layers: fewer layers, since a batch-1 step costs per
#          layer) on the same data, into $D/draft; checkpoints stay on the machine
#   draft2 the same with 2 layers, into $D/draft2 (not part of train)
#   invariant  the sweep with the target's engines batch-invariant (--batch-invariant: outputs identical in bf16 too),
#          each draft's steps in the megakernel, against the batch-invariant and the compiled target alone
#   checkpoint  on those checkpoints: validation perplexity and batch-1 speed of int8 and int4
#          (GPTQ), and speculative decoding with the draft against the target alone
#   sweep  speculative decoding with each draft trained ($D/draft, $D/draft2), its one-token steps compiled and
#          in the decode megakernel, at each K, against the target alone (sweep_speculative.py)
# Env: STEPS (target training steps, 600), DRAFT_STEPS (STEPS), TRAIN_COMPILE (true), TRAIN_SECONDS (none),
#      QUANT (entries for checkpoint, "int8 int4"; empty: speculative decoding only), CORPUS,
#      TOKENIZER (its overrides, "tokenizer.vocab_size=8192"; "tokenizer=byte" for bytes), TARGET_LR (optim.lr
#      of the target, 0.003), K (the sweep's draft tokens per round, "4 6"), SWEEP_SECONDS (its budget, 300).
# Usage: experiments/inference/run.sh OUT_DIR [tests|bench|quant|train|checkpoint ...]
#        (tests bench quant by default; checkpoint needs train in the same call, or in an earlier call
#        on the same machine while it stays warm: a machine given back keeps nothing)
set -euo pipefail
D=${1:?usage: run.sh OUT_DIR [tests|bench|quant ...]}
shift
PARTS=${*:-tests bench quant}
mkdir -p "$D"
LMLAB="python -m lmlab.cli.main"  # runs from a checkout without installing, as on the GPU machine
B="$LMLAB bench generate model=llama400m model.vocab_size=50304 --prompt 128 --new 256 --repeats 1"
CORPUS=${CORPUS:-outputs/data/tinyshakespeare.txt}
DATA="data=text_files data.paths=[$CORPUS] ${TOKENIZER:-tokenizer.vocab_size=8192} model.vocab_size=50304 data.context_length=512
      data.batch_size=32 trainer.compile=${TRAIN_COMPILE:-true} trainer.progress_bar=false cache_dir=$D/cache"
TRAIN="python -m lmlab.cli.train $DATA trainer.val_every=200 trainer.checkpoint_every=100000 ckpt_path=auto"
PARTS=${PARTS//train/target draft}
for part in $PARTS; do
    echo "== $part -> $D" >&2
    case $part in
        tests) python -m pytest -q -m gpu tests/inference -p no:cacheprovider 2>&1 | tail -15 | tee "$D/gpu-tests.txt" ;;
        bench) $B --engines compiled,hf --batch 1 8 32 128 --json "$D/bench.json" --plot "$D/decode_tokens_per_s.png" \
                   2>&1 | grep -v -i warn | tee "$D/bench.txt"
               $B --engines eager --batch 1 --json "$D/bench-eager.json" 2>&1 | grep -v -i warn | tail -3 \
                   | tee "$D/bench-eager.txt" ;;
        megakernel) python -m pytest -q -m gpu tests/inference/test_megakernel.py tests/kernels/test_decode_attention_triton.py \
                        tests/kernels/test_normed_head_triton.py -p no:cacheprovider 2>&1 | tail -15 \
                        | tee "$D/gpu-tests-megakernel.txt"
                    ${B/--repeats 1/--repeats 3} --engines megakernel,megakernel-stages,compiled --batch 1 8 32 \
                        --json "$D/bench-megakernel.json" 2>&1 | grep -v -i warn | tee "$D/bench-megakernel.txt" ;;
        quant) $B --engines compiled,megakernel --batch 1 --quant int8 int4 --json "$D/bench-quant.json" 2>&1 \
                   | grep -v -i warn | tail -12 | tee "$D/bench-quant.txt" ;;
        ncu)
            NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1 || true)
            for q in none int8; do
                timeout 240 "$NCU" --clock-control none --profile-from-start off --set full -k regex:layers_kernel \
                    -f -o /tmp/ncu-megakernel-$q python experiments/inference/ncu_megakernel.py --quant $q 2>&1 \
                    | tail -5 || true
                "$NCU" -i /tmp/ncu-megakernel-$q.ncu-rep --page details >> "$D/ncu-megakernel-details.txt" || true
                "$NCU" -i /tmp/ncu-megakernel-$q.ncu-rep --page raw --csv >> /tmp/ncu-megakernel-raw.csv || true
            done
            gzip -c /tmp/ncu-megakernel-raw.csv > "$D/ncu-megakernel-raw.csv.gz" || true
            "$NCU" -i /tmp/ncu-megakernel-none.ncu-rep --page source --csv --print-source sass \
                | gzip > "$D/ncu-megakernel-sass.csv.gz" || true ;;
        quant-ab) python experiments/inference/ab_megakernel_steps.py quant=none quant=int8 quant=int4 --rounds 9 \
                      --out "$D/ab-quant.json" 2>&1 | grep -v -i warn | tee "$D/ab-quant.txt" ;;
        target) # timeout's 124 (TRAIN_SECONDS ran out: the run saved and stopped) is not a failure
                ${TRAIN_SECONDS:+timeout -s TERM $TRAIN_SECONDS} $TRAIN model=llama400m trainer.max_steps=${STEPS:-600} optim.lr=${TARGET_LR:-0.003} \
                    hydra.run.dir="$D/target" 2>&1 | tail -4 | tee -a "$D/train-target.txt" || [ $? = 124 ] ;;
        draft) $TRAIN model=llama400m model.d_model=768 model.n_layers=4 model.attention.n_heads=12 \
                   trainer.max_steps=${DRAFT_STEPS:-${STEPS:-600}} hydra.run.dir="$D/draft" 2>&1 | tail -4 \
                   | tee "$D/train-draft.txt" ;;
        draft2) $TRAIN model=llama400m model.d_model=768 model.n_layers=2 model.attention.n_heads=12 \
                    trainer.max_steps=${DRAFT_STEPS:-${STEPS:-600}} hydra.run.dir="$D/draft2" 2>&1 | tail -4 \
                    | tee "$D/train-draft2.txt" ;;
        sweep) python experiments/inference/sweep_speculative.py "$D/target/checkpoints/last.ckpt" \
                   --drafts $(ls "$D"/draft*/checkpoints/last.ckpt) --k ${K:-4 6} --draft-engines compiled megakernel \
                   --budget-s ${SWEEP_SECONDS:-300} --json "$D/sweep-speculative.json" 2>&1 \
                   | grep --line-buffered -v -i warn | tee "$D/sweep-speculative.txt" ;;
        invariant) python experiments/inference/sweep_speculative.py "$D/target/checkpoints/last.ckpt" \
                       --drafts $(ls "$D"/draft*/checkpoints/last.ckpt) --k ${K:-4 5} --draft-engines megakernel \
                       --batch-invariant --budget-s ${SWEEP_SECONDS:-300} --json "$D/sweep-invariant.json" 2>&1 \
                       | grep --line-buffered -v -i warn | tee "$D/sweep-invariant.txt" ;;
        checkpoint) $LMLAB bench generate --ckpt "$D/target/checkpoints/last.ckpt" --engines compiled --batch 1 \
                        --prompt 128 --new 256 --repeats 1 --quant ${QUANT-int8 int4} --draft "$D/draft/checkpoints/last.ckpt" \
                        --json "$D/bench-checkpoint.json" 2>&1 | grep --line-buffered -v -i warn \
                        | tee "$D/bench-checkpoint.txt" ;;
        *) echo "unknown part '$part'; parts: tests bench megakernel ncu quant quant-ab train target draft draft2" \
                "checkpoint sweep invariant" >&2; exit 2 ;;
    esac
done
