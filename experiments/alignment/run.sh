#!/usr/bin/env bash
# The alignment experiment: multi-step arithmetic, from pre-training to RL, in parts that each fit one
# device-tool call (a warm machine keeps $D between calls):
#   base  data (make_data.py), pre-training on worked solutions, SFT on chat-formatted ones, then the SFT
#         model's greedy test accuracy, its pass@8 at the rollout temperature, and DPO pairs from its own
#         samples (8 to each of 4,000 RL prompts). There are 20,000 RL prompts, so that 600 RL steps of 64
#         prompts see each about twice: prompts repeated more often get memorised rather than solved (the
#         first run's held-out accuracy stopped rising after one pass over 3,800 prompts). 2,000 test
#         prompts: 500 put one accuracy's standard error at about 2 points.
#   rl    for each seed: GRPO (grpo_clip), Dr. GRPO (dr_grpo) and PPO from the SFT checkpoint, and DPO on
#         the pairs, all side by side; each final checkpoint's greedy accuracy on the test prompts
#   plot  collect.sh's copy of the small results in $D/results, then its table.md and the reward and
#         response-length curves (plot.py)
# Env: SEEDS ("0 1 2"), METHODS ("grpo dr_grpo ppo dpo"), RL_STEPS (optimizer steps per RL run), RL_LR (1e-4),
#      RL_T (the rollouts' sampling temperature, 0.7), RL_BATCH (responses per step, 512), GROUP (responses per
#      prompt, 8), EPOCHS (optimizer steps per rollout batch, 1), RL_STOP (a stop string of the rollouts and of their
#      test answers, e.g. '</answer>'; none by default), RL_ARGS (more overrides of the RL runs), TAG (appended to
#      the run names: a sweep beside the main runs), PRE_STEPS, SFT_STEPS, DPO_STEPS, N (data scale: corpus
#      problems), MODEL (model overrides), SMALL=1 (a CPU-sized model and run, to check the pipeline).
# The rl part's runs (every method and seed) train side by side, in parallel processes: a 3.5M-parameter model
# leaves the GPU idle through most of each decode step.
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
    RL_BATCH=${RL_BATCH:-16}; SEEDS=${SEEDS:-0}; SETS="--sft 400 --rl 200 --test 50"
    METHODS=${METHODS:-grpo dr_grpo ppo}  # a model this small answers nothing right: no DPO pairs
else
    MODEL=${MODEL:-"model.d_model=256 model.n_layers=4 model.attention.n_heads=4 model.max_seq_len=128"}
fi
N=${N:-40000}; SETS=${SETS:-"--sft 4000 --rl 20000 --test 2000"}; PRE_STEPS=${PRE_STEPS:-1500}; SFT_STEPS=${SFT_STEPS:-100}; RL_STEPS=${RL_STEPS:-600}
DPO_STEPS=${DPO_STEPS:-100}; SEEDS=${SEEDS:-0 1 2}; METHODS=${METHODS:-grpo dr_grpo ppo dpo}
RL_BATCH=${RL_BATCH:-512}; RL_T=${RL_T:-0.7}; RL_LR=${RL_LR:-1e-4}; TAG=${TAG:-}; GROUP=${GROUP:-8}; EPOCHS=${EPOCHS:-1}
RL_STOP=${RL_STOP:-}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}  # the parallel runs share the CPU cores
for name in $PARTS $METHODS; do  # every name checked before any long work starts
    case $name in
        base|rl|plot|grpo|dr_grpo|ppo|dpo) ;;
        *) echo "unknown part or method '$name'; parts: base rl plot (METHODS: grpo dr_grpo ppo dpo)" >&2; exit 2 ;;
    esac
done
SFT=$D/sft/checkpoints/last.ckpt
mkdir -p "$D"
for part in $PARTS; do
    echo "== $part -> $D" >&2
    case $part in
        base)
            python "$HERE/make_data.py" "$D/data" --corpus "$N" $SETS
            $TRAIN data=text_files "data.paths=[$D/data/corpus.txt]" tokenizer.vocab_size=512 $MODEL \
                data.context_length=128 data.batch_size=64 trainer.max_steps=$PRE_STEPS trainer.val_every=500 \
                optim.lr=3e-3 sched.warmup_steps=$((PRE_STEPS / 20)) hydra.run.dir=$D/pretrain 2>&1 | tail -2
            $TRAIN task=sft task.data=$D/data/sft.jsonl task.batch_size=64 init_from=$D/pretrain/checkpoints/last.ckpt \
                trainer.max_steps=$SFT_STEPS trainer.val_every=$SFT_STEPS optim.lr=1e-3 sched.warmup_steps=$((SFT_STEPS / 10)) \
                hydra.run.dir=$D/sft 2>&1 | tail -1
            $EVAL "$SFT" "$D/data/test.jsonl" --json "$D/eval/sft.json"
            # 8 samples per prompt at the rollouts' temperature and batch: pass@8 (how far RL's sharpening can
            # go), the plain-decoding figure that rollouts compare with, and the DPO pairs
            head -n 4000 "$D/data/rl.jsonl" > "$D/data/dpo-prompts.jsonl"
            $EVAL "$SFT" "$D/data/dpo-prompts.jsonl" --json "$D/eval/sft-samples.json" --samples 8 --temperature "$RL_T" \
                --batch "$RL_BATCH" --pairs "$D/data/dpo.jsonl"
            $EVAL "$SFT" "$D/data/test.jsonl" --json "$D/eval/sft-test-samples.json" --samples 8 --temperature "$RL_T" \
                --batch "$RL_BATCH" ;;
        rl)
            RL="task.data=$D/data/rl.jsonl reward=exact_match task.rollout_batch_size=$RL_BATCH task.group_size=$GROUP task.epochs=$EPOCHS
                task.micro_batch_size=$((RL_BATCH > 256 ? 256 : RL_BATCH)) task.temperature=$RL_T task.max_new_tokens=64
                task.val_fraction=0.05 init_from=$SFT trainer.max_steps=$RL_STEPS
                trainer.val_every=$((RL_STEPS / 5 > 0 ? RL_STEPS / 5 : 1)) trainer.log_every=1 optim.lr=$RL_LR
                sched=constant sched.warmup_steps=$((RL_STEPS / 20)) optim.weight_decay=0 ${RL_ARGS:-}"
            DPO="task=dpo task.data=$D/data/dpo.jsonl task.batch_size=32 init_from=$SFT trainer.max_steps=$DPO_STEPS
                trainer.val_every=$DPO_STEPS trainer.log_every=5 optim.lr=1e-5 sched.warmup_steps=$((DPO_STEPS / 10))"
            STOP=()  # evaluate.py answers the test prompts with the rollouts' stop string
            [ -n "$RL_STOP" ] && { RL="$RL task.stop=['$RL_STOP']"; STOP=(--stop "$RL_STOP"); }
            mkdir -p "$D/logs"
            pids=()
            for seed in $SEEDS; do
                for method in $METHODS; do
                    case $method in  # the task and rl_loss of each method
                        grpo) args="task=grpo rl_loss=grpo_clip $RL" ;;
                        dr_grpo) args="task=grpo rl_loss=dr_grpo $RL" ;;
                        ppo) args="task=ppo rl_loss=ppo $RL" ;;
                        dpo) args=$DPO ;;
                    esac
                    run=$method$TAG-$seed; stop=("${STOP[@]}")
                    [ $method = dpo ] && stop=()  # DPO's model ends its turn as the SFT model does
                    ( $TRAIN $args seed=$seed hydra.run.dir=$D/$run > "$D/logs/$run.log" 2>&1 &&
                      $EVAL "$D/$run/checkpoints/last.ckpt" "$D/data/test.jsonl" --json "$D/eval/$run.json" \
                          "${stop[@]}" >> "$D/logs/$run.log" 2>&1 ) &
                    pids+=("$!:$run")
                done
            done
            failed=0
            for entry in "${pids[@]}"; do
                wait "${entry%%:*}" || { failed=1; echo "${entry#*:} failed: $D/logs/${entry#*:}.log" >&2; }
                tail -n 1 "$D/logs/${entry#*:}.log"
            done
            [ $failed = 0 ] ;;
        plot) bash "$HERE/collect.sh" "$D" "$D/results" && python "$HERE/plot.py" "$D/results" ;;
    esac
done
