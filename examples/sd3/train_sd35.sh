#!/usr/bin/env bash
# SD3.5, FlowGRPO with flow_grpo's published SD3.5 hyper-parameters (examples/sd3/recipe.py: resolution 512,
# 10 steps, CFG 4.5, noise level 0.7, window 2, 48 prompts x 24, clip range 1e-4, lr 3e-4, LoRA 32/64; each
# setting's source in the recipe's docstring), on NNODES nodes x 8 GPUs:
#   SIZE=medium (SD3.5-Medium 2.5B, default NNODES=1: 6 trainer ranks, the reward on GPUs 6,7)
#   SIZE=large  (SD3.5-Large 8B, default NNODES=2: 16 trainer ranks, the reward server on node 0's CPUs)
#   REWARD=ocr (flow_grpo's general_ocr_sd3, default) | pickscore (pickscore_sd3)
# Layout: tp=1 x dp, LoRA on the block linears, no recompute; the micro-batch is the recipe's (fits H200 and H800).
# Plain torchrun form: run it on every node with its NODE_RANK (or submit it through the Slurm script:
#   LAUNCH_SCRIPT=examples/sd3/train_sd35.sh SIZE=large sbatch --nodes=2 examples/qwen_image/slurm_20b.sbatch).
#   SIZE=medium DRY_RUN=1 bash examples/sd3/train_sd35.sh                 # layout, memory per GPU, step time
#   SIZE=large GPU_KIND=H800 DRY_RUN=1 bash examples/sd3/train_sd35.sh
#   SIZE=large NODE_RANK=i MASTER_ADDR=node0 REWARD_SERVER_TOKEN=<same on every node> bash examples/sd3/train_sd35.sh
# DRY_RUN=1 starts nothing: it validates the layout for this world size and prints the plan; LAUNCH_ECHO=1 prints
# the commands instead of starting them. Knobs: launch_lib.bash. Exit status: the entry point's (0 ok, 2 config,
# 3 dry run does not fit, 4 log-prob gap), 5 when a signal stopped the run after a checkpoint (--resume auto).
set -euo pipefail

SIZE="${SIZE:-medium}"
case "$SIZE" in
    medium) DEFAULT_NNODES=1; DEFAULT_REWARD_GPUS=6,7; DEFAULT_REWARD_DEVICE=cuda ;;
    large) DEFAULT_NNODES=2; DEFAULT_REWARD_GPUS=""; DEFAULT_REWARD_DEVICE=cpu ;;
    *) echo "train_sd35: SIZE=$SIZE: expected medium or large" >&2; exit 2 ;;
esac
REWARD="${REWARD:-ocr}"
case "$REWARD" in
    ocr|pickscore) ;;
    *) echo "train_sd35: REWARD=$REWARD: expected ocr or pickscore" >&2; exit 2 ;;
esac
NNODES="${NNODES:-$DEFAULT_NNODES}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"  # node 0's address (set it on multi-node runs)
MASTER_PORT="${MASTER_PORT:-29500}"
REWARD_GPUS="${REWARD_GPUS-$DEFAULT_REWARD_GPUS}"  # GPUs of each node kept for the reward (not trainer ranks)
REWARD_KIND="${REWARD_KIND:-server}"
REWARD_SCORER="${REWARD_SCORER:-$REWARD}"
REWARD_DEVICE_KIND="${REWARD_DEVICE_KIND:-$DEFAULT_REWARD_DEVICE}"
REWARD_PORT="${REWARD_PORT:-8000}"
PIPELINE_DIR="${PIPELINE_DIR:-/models/stable-diffusion-3.5-${SIZE}}"  # the diffusers StableDiffusion3Pipeline folder
OCR_PROMPTS="${OCR_PROMPTS:-}"  # prompts file, one per line ("" = the built-in OCR list)
RUN_DIR="${RUN_DIR:-runs/sd35-${SIZE}-${REWARD}-${NNODES}nodes}"
RECIPE="${RECIPE:-examples.sd3.recipe:sd35_${SIZE}_${REWARD}}"
GPU_KIND="${GPU_KIND:-H200}"  # for the dry run's figures: H200 | H800
DRY_RUN="${DRY_RUN:-0}"
export OCR_PROMPTS

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
# shellcheck source=examples/qwen_image/launch_lib.bash
source examples/qwen_image/launch_lib.bash
launch "$@"
