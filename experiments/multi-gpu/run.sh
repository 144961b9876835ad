#!/usr/bin/env bash
# The multi-GPU measurements, on one host with N GPUs (default: all of them):
#   comm      all-reduce (and the other collectives) bus bandwidth, 1 MB to 1 GB
#   parallel  every dense strategy on the ~400M config (d_model 1024, 24 layers, seq 2048, vocab 50304,
#             global batch 32): step time, tokens/s per GPU, scaling against one GPU, memory (lmlab's
#             own FSDP, zero3, against PyTorch's FSDP2, fsdp; tp, pp and cp split the model instead)
#   fit       an ~10.9B-parameter model (d_model 4096, 52 layers) that needs ~174 GB for weights,
#             gradients and AdamW state unsharded and ~131 GB per GPU under zero1 on two (weights and
#             gradients whole, half the state), before activations: single, ddp and zero1 run out
#             of memory, fsdp (~87 GB per GPU on two) trains; zero3 and tp against it
#   long      the ~400M config on N sequences of LONG_SEQ tokens (default 131072): one GPU (a sequence at a time)
#             against cp (ring attention, each GPU its slice of every sequence)
#   moe       the ~400M config with 8-expert top-2 MoE FFNs: ddp against ep (experts spread over the GPUs)
#   multirun  a 2-job Hydra multirun of 2-GPU DDP jobs (ddp and bucketed_ddp) on the default corpus,
#             STEPS steps each (default 300)
# Usage: experiments/multi-gpu/run.sh OUT_DIR [PART ...]   (all parts by default)
# SIZE=small runs every part at toy sizes on CPUs with gloo, to check the script itself.
set -euo pipefail
D=${1:?usage: run.sh OUT_DIR [comm|parallel|fit|long|moe|multirun ...]}
shift
PARTS=${*:-comm parallel fit multirun}
mkdir -p "$D"
# Run from a checkout without installing, as on the GPU machine; `lmlab` and `lmlab-train` are the same.
LMLAB="python -m lmlab.cli.main"
TRAIN="python -m lmlab.cli.train"
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
N=${N:-$(( GPUS >= 2 ? GPUS : 2 ))}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast stays off on the lent machines
if [[ ${SIZE:-full} == small ]]; then
    COMM="--sizes 1K 64K 1M"
    M400="--d-model 64 --n-layers 2 --n-heads 4 --seq 64 --vocab 512 --batch 4 --steps 3"
    BIG="--d-model 64 --n-layers 2 --n-heads 4 --seq 64 --vocab 512 --batch $N --steps 3"
    LONG="--d-model 64 --n-layers 2 --n-heads 4 --seq 256 --vocab 512 --steps 3"
    RUN="model=tiny trainer.max_steps=6 trainer.val_every=6 sched.warmup_steps=1"
else
    COMM="--sizes 1M 4M 16M 64M 256M 1G"
    M400="--d-model 1024 --n-layers 24 --n-heads 16 --seq 2048 --vocab 50304 --batch 32 --steps 7"
    BIG="--d-model 4096 --n-layers 52 --n-heads 32 --seq 2048 --vocab 50304 --batch $N --steps 4"
    LONG="--d-model 1024 --n-layers 24 --n-heads 16 --seq ${LONG_SEQ:-131072} --vocab 50304 --steps 3"
    RUN="trainer.max_steps=${STEPS:-300}"
fi
for part in $PARTS; do
    echo "== $part ($N ranks) -> $D" >&2
    case $part in
        comm) $LMLAB bench comm --world-size "$N" $COMM --json "$D/comm.json" | tee "$D/comm.txt" ;;
        parallel) $LMLAB bench parallel --world-size "$N" $M400 --json "$D/parallel-400m.json" \
                      --strategies single ddp naive_ddp bucketed_ddp zero1 fsdp zero3 tp pp cp | tee "$D/parallel-400m.txt" ;;
        fit) $LMLAB bench parallel --world-size "$N" --strategies single ddp zero1 fsdp zero3 tp $BIG \
                 --json "$D/parallel-fit.json" | tee "$D/parallel-fit.txt" ;;
        long) $LMLAB bench parallel --world-size "$N" --strategies single cp $LONG --batch "$N" \
                  --json "$D/parallel-long.json" | tee "$D/parallel-long.txt" ;;
        moe) $LMLAB bench parallel --world-size "$N" --strategies single ddp ep $M400 --experts 8 --top-k 2 \
                 --json "$D/parallel-moe.json" | tee "$D/parallel-moe.txt" ;;
        multirun) $TRAIN -m parallel=ddp,bucketed_ddp trainer.devices=2 trainer.progress_bar=false $RUN \
                      hydra.sweep.dir="$D/multirun" 2>&1 | tail -20 | tee "$D/multirun.txt" ;;
        *) echo "unknown part '$part'; parts: comm parallel fit long moe multirun" >&2; exit 2 ;;
    esac
done
