#!/usr/bin/env bash
# Qwen-Image 20B, FlowGRPO x OCR reward: 1 node x 8 GPUs (6 trainer ranks at tp=6, the reward on GPUs 6,7).
# Plain torchrun form: run it on every node with its NODE_RANK (or submit slurm_20b.sbatch).
#   bash examples/qwen_image/train_20b_1node.sh [--set steps=100 ...]
# DRY_RUN=1 starts nothing: it validates the layout for this script's world size and prints the plan.
# Knobs are described in launch_lib.bash, the layouts in docs/parallelism.md.
set -euo pipefail

NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"  # node 0's address
MASTER_PORT="${MASTER_PORT:-29500}"
REWARD_GPUS="${REWARD_GPUS-6,7}"  # GPUs of each node kept for the reward (not trainer ranks)
REWARD_KIND="${REWARD_KIND:-server}"  # server | vlm (vllm serve JUDGE_MODEL) | url (REWARD_URL) | none
REWARD_SCORER="${REWARD_SCORER:-ocr}"  # what the reward server runs (REWARD_KIND=server)
REWARD_PORT="${REWARD_PORT:-8000}"
PIPELINE_DIR="${PIPELINE_DIR:-/models/Qwen-Image}"  # the diffusers Qwen-Image folder
OCR_PROMPTS="${OCR_PROMPTS:-}"  # prompts file, one per line ("" = the recipe's built-in list)
RUN_DIR="${RUN_DIR:-runs/qwen-image-20b-ocr-1node}"
CFG="${CFG:-0}"  # 1 = the CFG variant (true CFG 4.0)
CFG_SUFFIX=""
if [[ "$CFG" == 1 ]]; then CFG_SUFFIX="_cfg"; fi
RECIPE="${RECIPE:-examples.qwen_image.recipe:ocr_20b${CFG_SUFFIX}_1node}"
GPU_KIND="${GPU_KIND:-H200}"  # for the dry run's figures: H200 | H800
DRY_RUN="${DRY_RUN:-0}"
export OCR_PROMPTS

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
# shellcheck source=examples/qwen_image/launch_lib.bash
source examples/qwen_image/launch_lib.bash
launch "$@"
