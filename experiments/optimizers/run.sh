#!/usr/bin/env bash
# AdamW vs Muon vs Lion, a learning-rate sweep each (widened until it brackets the best), then
# cosine vs WSD at equal steps, on the default corpus and model (d_model 128, 4 layers, 300 steps
# of 32 x 128 tokens, cosine schedule).
set -euo pipefail
D=${1:-outputs/optimizers}
C="trainer.progress_bar=false"
lmlab-train -m $C hydra.sweep.dir=$D/lr/adamw optim=adamw optim.lr=1e-3,3e-3,1e-2
lmlab-train -m $C hydra.sweep.dir=$D/lr/muon optim=muon optim.lr=0.005,0.02,0.05,0.1
lmlab-train -m $C hydra.sweep.dir=$D/lr/lion optim=lion optim.lr=1e-4,3e-4,1e-3,3e-3,1e-2
lmlab-compare $D/lr
lmlab-train -m $C hydra.sweep.dir=$D/schedules sched=cosine,wsd
lmlab-compare $D/schedules
lmlab plot-lr sched=wsd --out $D/schedules/wsd_lr.png
lmlab plot-lr sched=cosine --out $D/schedules/cosine_lr.png
