#!/usr/bin/env bash
# FLUX.1-dev (12B, guidance-distilled: one forward per sampling step, no CFG rows), FlowGRPO with DanceGRPO's FLUX
# hyper-parameters (examples/flux/recipe.py: 720 x 720, 16 steps, a window of 10, 16 prompts x 12, clip range 1e-4,
# lr 1e-5, full fine-tuning, distilled guidance 3.5; each setting's source in the recipe's docstring), on NNODES
# nodes x 8 GPUs:
#   NNODES=1 (default: 8 trainer ranks, the reward server on node 0's CPUs) | NNODES=2 (16 trainer ranks)
#   REWARD=pickscore (default) | ocr
# Layout: tp=4 x dp, full recompute, the distributed optimizer; 71.8 GiB (1 node) / 63.3 GiB (2 nodes) per GPU as
# planned: fits H200 and H800.
# Plain torchrun form: run it on every node with its NODE_RANK (or submit it through the Slurm script:
#   LAUNCH_SCRIPT=examples/flux/train_flux.sh NNODES=2 sbatch --nodes=2 examples/qwen_image/slurm_20b.sbatch).
#   DRY_RUN=1 bash examples/flux/train_flux.sh                            # layout, memory per GPU, step time
#   NNODES=2 GPU_KIND=H800 DRY_RUN=1 bash examples/flux/train_flux.sh
#   NNODES=2 NODE_RANK=i MASTER_ADDR=node0 REWARD_SERVER_TOKEN=<same on every node> bash examples/flux/train_flux.sh
# DRY_RUN=1 starts nothing: it validates the layout for this world size and prints the plan; LAUNCH_ECHO=1 prints
# the commands instead of starting them. Knobs: launch_lib.bash. Exit status: the entry point's (0 ok, 2 config,
# 3 dry run does not fit, 4 log-prob gap), 5 when a signal stopped the run after a checkpoint (--resume auto).
set -euo pipefail

NNODES="${NNODES:-1}"
case "$NNODES" in
    1) RECIPE_NODES=1node ;;
    2) RECIPE_NODES=2nodes ;;
    *) echo "train_flux: NNODES=$NNODES: expected 1 or 2 (the recipe's planned layouts)" >&2; exit 2 ;;
esac
REWARD="${REWARD:-pickscore}"
case "$REWARD" in
    pickscore) RECIPE_REWARD="" ;;
    ocr) RECIPE_REWARD="_ocr" ;;
    *) echo "train_flux: REWARD=$REWARD: expected pickscore or ocr" >&2; exit 2 ;;
esac
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"  # node 0's address (set it on multi-node runs)
MASTER_PORT="${MASTER_PORT:-29500}"
REWARD_GPUS="${REWARD_GPUS-}"  # GPUs of each node kept for the reward (not trainer ranks)
REWARD_KIND="${REWARD_KIND:-server}"
REWARD_SCORER="${REWARD_SCORER:-$REWARD}"
REWARD_DEVICE_KIND="${REWARD_DEVICE_KIND:-cpu}"
REWARD_PORT="${REWARD_PORT:-8000}"
PIPELINE_DIR="${PIPELINE_DIR:-/models/FLUX.1-dev}"  # the diffusers FluxPipeline folder
OCR_PROMPTS="${OCR_PROMPTS:-}"  # prompts file, one per line ("" = the built-in OCR list)
RUN_DIR="${RUN_DIR:-runs/flux1-dev-${REWARD}-${NNODES}nodes}"
RECIPE="${RECIPE:-examples.flux.recipe:flux1_dev_${RECIPE_NODES}${RECIPE_REWARD}}"
GPU_KIND="${GPU_KIND:-H200}"  # for the dry run's figures: H200 | H800
DRY_RUN="${DRY_RUN:-0}"
export OCR_PROMPTS

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
# shellcheck source=examples/qwen_image/launch_lib.bash
source examples/qwen_image/launch_lib.bash
launch "$@"
