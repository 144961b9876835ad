#!/usr/bin/env bash
# Dense SwiGLU FFN (d_ff 384) vs top-2-of-8 experts of d_ff 192 (same active parameters per token),
# with the Switch aux loss (0.01), without it, and with aux-loss-free bias balancing, on the
# default corpus and model (d_model 128, 4 layers, 300 steps of 32 x 128 tokens).
set -euo pipefail
D=${1:-outputs/moe-vs-dense}
COMMON="trainer.progress_bar=false"
lmlab-train $COMMON hydra.run.dir=$D/dense
lmlab-train -m $COMMON hydra.sweep.dir=$D/topk model/moe=topk model.moe.d_ff=192 model.moe.aux_loss_weight=0.01,0.0
lmlab-train $COMMON hydra.run.dir=$D/aux_free model/moe=aux_free model.moe.d_ff=192
lmlab-compare $D
