# A short check of the RL learning rate: pre-train 600 steps, SFT, then GRPO at 2e-5 and 1e-5 (40 steps).
set -u
D=outputs/a2; H=experiments/alignment; S=$OUT/summary.txt
TRAIN="python -m lmlab.cli.train logger=csv trainer.progress_bar=false cache_dir=$D/cache"
MODEL="model.d_model=256 model.n_layers=4 model.attention.n_heads=4 model.max_seq_len=128"
python $H/make_data.py $D/data --corpus 40000 --sft 4000 --rl 4000 --test 500 >> $S
$TRAIN data=text_files "data.paths=[$D/data/corpus.txt]" tokenizer.vocab_size=512 $MODEL data.context_length=128 data.batch_size=64 trainer.max_steps=600 trainer.val_every=600 optim.lr=3e-3 sched.warmup_steps=30 hydra.run.dir=$D/pre 2>&1 | tail -1 | cut -c 60-160 >> $S
$TRAIN task=sft task.data=$D/data/sft.jsonl task.batch_size=64 init_from=$D/pre/checkpoints/last.ckpt trainer.max_steps=100 trainer.val_every=100 optim.lr=1e-3 sched.warmup_steps=10 hydra.run.dir=$D/sft 2>&1 | tail -1 | cut -c 60-160 >> $S
python $H/evaluate.py $D/sft/checkpoints/last.ckpt $D/data/test.jsonl --json $OUT/sft.json | cut -c 1-200 >> $S
for lr in 2e-5 1e-5; do
$TRAIN task=grpo rl_loss=grpo_clip task.data=$D/data/rl.jsonl reward=exact_match task.rollout_batch_size=128 task.group_size=8 task.micro_batch_size=64 task.max_new_tokens=64 init_from=$D/sft/checkpoints/last.ckpt trainer.max_steps=40 trainer.val_every=10 trainer.log_every=1 optim.lr=$lr sched=constant sched.warmup_steps=0 optim.weight_decay=0 hydra.run.dir=$D/grpo-$lr 2>&1 | tail -1 | cut -c 60-200 >> $S
python $H/evaluate.py $D/grpo-$lr/checkpoints/last.ckpt $D/data/test.jsonl --json $OUT/grpo-$lr.json | cut -c 1-200 >> $S
cp $(find $D/grpo-$lr -name metrics.csv) $OUT/grpo-$lr.csv
done
