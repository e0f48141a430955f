#!/usr/bin/env bash
# Qwen-Image 20B LoRA (rank 64, alpha 128: flow_grpo's recipe), FlowGRPO x OCR reward on one node of 4 x H800
# (80 GB), VeRL-Omni's LoRA setting. The base stays frozen in bf16; only the adapters train (docs/lora.md).
#   REWARD_ON_GPU=1 (default): GPU 3 runs the OCR reward server, 3 trainer ranks at pp=3, vLLM-Omni at rollout tp=3
#   REWARD_ON_GPU=0:           4 trainer ranks at pp=4, vLLM-Omni at rollout tp=1, the OCR server on CPU workers
# (REWARD_GPUS=<list> sets the reward GPUs directly; 1 or none of them pick the layouts above.) Both layouts are
# the fastest the dry-run planner finds that leave 10% of the GPU free (docs/parallelism.md).
#   bash examples/qwen_image/train_20b_lora_h800.sh [--set steps=100 ...]
#   GPU_KIND=H800 DRY_RUN=1 bash examples/qwen_image/train_20b_lora_h800.sh   # the plan: memory and step time
# DRY_RUN=1 starts nothing: it validates the layout for this world size and prints the plan (with its LoRA line);
# LAUNCH_ECHO=1 prints the commands instead of starting them. Extra --set arguments override the ones below.
# Exit status: the entry point's (0 ok, 2 config, 3 dry run does not fit, 4 log-prob gap), and 5 when a SIGTERM
# or SIGINT stopped the run after it wrote a checkpoint: start it again with --resume auto.
# Knobs are described in launch_lib.bash.
set -euo pipefail

NNODES=1
GPUS_PER_NODE="${GPUS_PER_NODE:-4}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
REWARD_ON_GPU="${REWARD_ON_GPU:-1}"  # 1: the reward server on GPU 3 | 0: no reward GPU (CPU workers)
case "$REWARD_ON_GPU" in
    1) DEFAULT_REWARD_GPUS=3 ;;
    0) DEFAULT_REWARD_GPUS="" ;;
    *) echo "train_20b_lora_h800: REWARD_ON_GPU=$REWARD_ON_GPU: expected 1 or 0" >&2; exit 2 ;;
esac
REWARD_GPUS="${REWARD_GPUS-$DEFAULT_REWARD_GPUS}"
REWARD_KIND="${REWARD_KIND:-server}"  # server | vlm (vllm serve JUDGE_MODEL) | url (REWARD_URL) | none
REWARD_SCORER="${REWARD_SCORER:-ocr}"
REWARD_PORT="${REWARD_PORT:-8000}"
PIPELINE_DIR="${PIPELINE_DIR:-/models/Qwen-Image}"  # the diffusers Qwen-Image folder
OCR_PROMPTS="${OCR_PROMPTS:-}"  # prompts file, one per line ("" = the recipe's built-in list)
RUN_DIR="${RUN_DIR:-runs/qwen-image-20b-ocr-lora-h800}"
RECIPE="${RECIPE:-examples.qwen_image.recipe:ocr_20b}"
GPU_KIND="${GPU_KIND:-H800}"  # for the dry run's figures
DRY_RUN="${DRY_RUN:-0}"
LORA_RANK="${LORA_RANK:-64}"
LORA_ALPHA="${LORA_ALPHA:-128}"
# The adapters wrap Megatron-Core's local linears (model.lora needs model.backend=local).
MODEL_BACKEND="${MODEL_BACKEND:-local}"
export OCR_PROMPTS MODEL_BACKEND

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
# shellcheck source=examples/qwen_image/launch_lib.bash
source examples/qwen_image/launch_lib.bash

# Layout by trainer ranks (from the planner, GPU_KIND=H800 DRY_RUN=1): pipeline stages rather than TP, whose
# all-reduces cost more over the H800's 400 GB/s NVLink than the bubble of 512 micro-batches.
case "$(( GPUS_PER_NODE - $(count_list "$REWARD_GPUS") ))" in
    3) LAYOUT=(--set parallel.pp=3 --set rollout.tp=3) ;;  # rollout tp=1 would need 74 of 80 GB
    4) LAYOUT=(--set parallel.pp=4 --set rollout.tp=1) ;;
    *) LAYOUT=() ;;  # another GPU count: set the layout with --set (the dry run checks it)
esac
launch "${LAYOUT[@]}" --set "model.lora.rank=${LORA_RANK}" --set "model.lora.alpha=${LORA_ALPHA}" "$@"
