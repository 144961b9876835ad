#!/usr/bin/env bash
# The inference issue's GPU measurements on one GPU, in parts that each fit one device-tool call:
#   tests  the CUDA-only engine and quantization tests
#   bench  lmlab bench generate on the ~400M config (random weights, vocab 50304, bf16): lmlab
#          compiled (CUDA graphs) and Hugging Face generate at batch 1, 8, 32, 128 with a 128-token
#          prompt and 256 new tokens, then lmlab eager at batch 1
#   quant  the compiled engine at batch 1 on int8 and int4 (group 64) copies of the same weights
#   train  a llama400m target and a ~4x smaller draft (d_model 768, 4 layers: fewer layers, since a
#          batch-1 step costs per layer) on tinyshakespeare (CORPUS=path), same BPE (vocab 8192 in a
#          50304-row embedding), into $D/target and $D/draft; checkpoints stay on the machine
#   checkpoint  on those checkpoints: validation perplexity and batch-1 speed of int8 and int4
#          (GPTQ), and speculative decoding with the draft against the target alone
# Env: STEPS (training steps, 600), TRAIN_COMPILE (true), QUANT (entries for checkpoint, "int8 int4";
#      empty: speculative decoding only), CORPUS.
# Usage: experiments/inference/run.sh OUT_DIR [tests|bench|quant|train|checkpoint ...]
#        (tests bench quant by default; train and checkpoint go in one call: the machine keeps nothing)
set -euo pipefail
D=${1:?usage: run.sh OUT_DIR [tests|bench|quant ...]}
shift
PARTS=${*:-tests bench quant}
mkdir -p "$D"
LMLAB="python -m lmlab.cli.main"  # runs from a checkout without installing, as on the GPU machine
B="$LMLAB bench generate model=llama400m model.vocab_size=50304 --prompt 128 --new 256 --repeats 1"
CORPUS=${CORPUS:-outputs/data/tinyshakespeare.txt}
DATA="data=text_files data.paths=[$CORPUS] tokenizer.vocab_size=8192 model.vocab_size=50304 data.context_length=512
      data.batch_size=32 trainer.compile=${TRAIN_COMPILE:-true} trainer.progress_bar=false cache_dir=$D/cache"
TRAIN="python -m lmlab.cli.train $DATA trainer.max_steps=${STEPS:-600} trainer.val_every=200"
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
        train) $TRAIN model=llama400m hydra.run.dir="$D/target" 2>&1 | tail -4 | tee "$D/train-target.txt"
               $TRAIN model=llama400m model.d_model=768 model.n_layers=4 model.attention.n_heads=12 \
                   hydra.run.dir="$D/draft" 2>&1 | tail -4 | tee "$D/train-draft.txt" ;;
        checkpoint) $LMLAB bench generate --ckpt "$D/target/checkpoints/last.ckpt" --engines compiled --batch 1 \
                        --prompt 128 --new 256 --repeats 1 --quant ${QUANT-int8 int4} --draft "$D/draft/checkpoints/last.ckpt" \
                        --json "$D/bench-checkpoint.json" 2>&1 | grep --line-buffered -v -i warn \
                        | tee "$D/bench-checkpoint.txt" ;;
        *) echo "unknown part '$part'; parts: tests bench quant train checkpoint" >&2; exit 2 ;;
    esac
done
