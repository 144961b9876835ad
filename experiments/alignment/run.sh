#!/usr/bin/env bash
# The alignment experiment: multi-step arithmetic, from pre-training to RL, in parts that each fit one
# device-tool call (a warm machine keeps $D between calls):
#   base  data (make_data.py), pre-training on worked solutions, SFT on chat-formatted ones, then the SFT
#         model's greedy test accuracy and DPO pairs from its own samples (4 per RL prompt, temperature 1)
#   rl    for each seed: GRPO (grpo_clip), Dr. GRPO (dr_grpo) and PPO from the SFT checkpoint, and DPO on
#         the pairs; each final checkpoint's greedy accuracy on the test prompts
#   plot  collect.sh's copy of the small results in $D/results, then its table.md and the reward and
#         response-length curves (plot.py)
# Env: SEEDS ("0 1 2"), RL_STEPS (optimizer steps per RL run), RL_LR (2e-5; the first H200 run used 1e-4), PRE_STEPS, SFT_STEPS, DPO_STEPS, N (data
#      scale: corpus problems), MODEL (model overrides), SMALL=1 (a CPU-sized model and run, to check the pipeline).
# Usage: experiments/alignment/run.sh OUT_DIR [base rl plot]
set -euo pipefail
D=${1:?usage: run.sh OUT_DIR [base rl plot]}
shift
PARTS=${*:-base rl plot}
HERE=$(dirname "$0")
TRAIN="python -m lmlab.cli.train logger=csv trainer.progress_bar=false cache_dir=$D/cache"
EVAL="python $HERE/evaluate.py"
if [ "${SMALL:-0}" = 1 ]; then
    MODEL="model.d_model=64 model.n_layers=2 model.attention.n_heads=2 model.max_seq_len=128"
    N=${N:-3000}; PRE_STEPS=${PRE_STEPS:-40}; SFT_STEPS=${SFT_STEPS:-20}; RL_STEPS=${RL_STEPS:-4}; DPO_STEPS=${DPO_STEPS:-4}
    RL_BATCH="task.rollout_batch_size=16 task.group_size=4"; SEEDS=${SEEDS:-0}
else
    MODEL=${MODEL:-"model.d_model=256 model.n_layers=4 model.attention.n_heads=4 model.max_seq_len=128"}
    RL_BATCH="task.rollout_batch_size=128 task.group_size=8 task.micro_batch_size=64"
fi
N=${N:-40000}; PRE_STEPS=${PRE_STEPS:-1500}; SFT_STEPS=${SFT_STEPS:-100}; RL_STEPS=${RL_STEPS:-100}
DPO_STEPS=${DPO_STEPS:-100}; SEEDS=${SEEDS:-0 1 2}
SFT=$D/sft/checkpoints/last.ckpt
mkdir -p "$D"
for part in $PARTS; do
    echo "== $part -> $D" >&2
    case $part in
        base)
            python "$HERE/make_data.py" "$D/data" --corpus "$N" --sft 4000 --rl 4000 --test 500
            $TRAIN data=text_files "data.paths=[$D/data/corpus.txt]" tokenizer.vocab_size=512 $MODEL \
                data.context_length=128 data.batch_size=64 trainer.max_steps=$PRE_STEPS trainer.val_every=500 \
                optim.lr=3e-3 sched.warmup_steps=$((PRE_STEPS / 20)) hydra.run.dir=$D/pretrain 2>&1 | tail -2
            $TRAIN task=sft task.data=$D/data/sft.jsonl task.batch_size=64 init_from=$D/pretrain/checkpoints/last.ckpt \
                trainer.max_steps=$SFT_STEPS trainer.val_every=$SFT_STEPS optim.lr=1e-3 sched.warmup_steps=$((SFT_STEPS / 10)) \
                hydra.run.dir=$D/sft 2>&1 | tail -1
            $EVAL "$SFT" "$D/data/test.jsonl" --json "$D/eval/sft.json"
            # 128 responses at a time, as one RL rollout: the plain-decoding figure that rollouts compare with
            $EVAL "$SFT" "$D/data/rl.jsonl" --json "$D/eval/sft-samples.json" --samples 4 --temperature 1 \
                --batch 128 --pairs "$D/data/dpo.jsonl" ;;
        rl)
            RL="task.data=$D/data/rl.jsonl reward=exact_match $RL_BATCH task.max_new_tokens=64 task.val_fraction=0.05
                init_from=$SFT trainer.max_steps=$RL_STEPS trainer.val_every=$((RL_STEPS / 5 > 0 ? RL_STEPS / 5 : 1))
                trainer.log_every=1 optim.lr=${RL_LR:-2e-5} sched=constant sched.warmup_steps=0 optim.weight_decay=0"
            for seed in $SEEDS; do
                for run in grpo:grpo:grpo_clip dr_grpo:grpo:dr_grpo ppo:ppo:ppo; do  # name:task:rl_loss
                    IFS=: read -r name task loss <<< "$run"
                    $TRAIN task=$task rl_loss=$loss $RL seed=$seed hydra.run.dir=$D/$name-$seed 2>&1 | tail -1
                    $EVAL "$D/$name-$seed/checkpoints/last.ckpt" "$D/data/test.jsonl" --json "$D/eval/$name-$seed.json"
                done
                $TRAIN task=dpo task.data=$D/data/dpo.jsonl task.batch_size=32 init_from=$SFT trainer.max_steps=$DPO_STEPS \
                    trainer.val_every=$DPO_STEPS trainer.log_every=5 optim.lr=1e-5 sched.warmup_steps=$((DPO_STEPS / 10)) seed=$seed \
                    hydra.run.dir=$D/dpo-$seed 2>&1 | tail -1
                $EVAL "$D/dpo-$seed/checkpoints/last.ckpt" "$D/data/test.jsonl" --json "$D/eval/dpo-$seed.json"
            done ;;
        plot) bash "$HERE/collect.sh" "$D" "$D/results" && python "$HERE/plot.py" "$D/results" ;;
        *) echo "unknown part '$part'; parts: base rl plot" >&2; exit 2 ;;
    esac
done
