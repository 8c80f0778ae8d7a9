#!/usr/bin/env bash
# DFlash2 draft for Qwen3-8B on UltraChat: a real recipe for a GPU box with hub access.
# (speculators' DFlash2 example shapes: B 8, 5 layers, 640 anchors, target ids [2,18,33],
#  fixed decay, kl_div, conv 2/16, rank 256, top-K 16, alpha_sel 1.0, lr 3e-4.)
set -euo pipefail
TARGET="${TARGET:-Qwen/Qwen3-8B}"
DATA="${DATA:-HuggingFaceH4/ultrachat_200k}"
NPROC="${NPROC:-1}"   # GPUs on this machine: data-parallel ranks under torchrun, the draft sharded with FSDP2
dflash-lab train --nproc-per-node "$NPROC" \
  --algorithm dflash2 --preset published \
  --target "$TARGET" --data "$DATA" --data-split train_sft --device cuda \
  --block-size 8 --num-layers 5 --target-layer-ids 2,18,33 \
  --loss-fn kl_div --per-position-loss-weight fixed-exp-decay --dflash-decay-gamma 4.0 \
  --max-anchors 640 --conv-kernel-size 2 --conv-group-size 16 \
  --selector-rank 256 --candidate-top-k 16 --selector-loss-alpha 1.0 \
  --lr 3e-4 --max-steps 20000 --num-conversations 50000 --num-validation 500 --row-length 8192 \
  "$@"
