#!/usr/bin/env bash
# Qwen-Image-Edit 20B, FlowGRPO x the edit_text reward (OCR of the text band + the source kept outside it), on
# NNODES nodes x 8 H200 (examples/qwen_image_edit/recipe.py: edit_20b_1node / edit_20b_2nodes):
#   NNODES=1: 6 trainer ranks at tp=6 with full recompute, the reward on GPUs 6,7
#   NNODES=2: 16 trainer ranks at tp=8 x dp=2, the distributed optimizer, the reward server on node 0's CPUs
#   NNODES=2 GPU_KIND=H800: the same on H800, sampled by the vLLM-Omni engine at rollout tp=8 (edit_20b_2nodes_h800;
#     the embedded engine's resident bf16 copy does not fit 80 GB)
#   NNODES=1 GPU_KIND=H800: 6 trainer ranks at tp=6 training LoRA adapters (rank 32; full fine-tuning does not fit),
#     the vLLM-Omni engine at rollout tp=6 (edit_20b_1node_h800)
# The planner counts the source image: its VAE latents (about 1024^2 px: 4096 tokens) follow the 1024 generated
# tokens in the image stream, and Qwen2.5-VL reads it (about 384^2 px: 196 vision tokens) with the instruction.
# Plain torchrun form: run it on every node with its NODE_RANK (or through the Slurm script:
#   LAUNCH_SCRIPT=examples/qwen_image_edit/train_edit_20b.sh sbatch --nodes=2 examples/qwen_image/slurm_20b.sbatch).
#   DRY_RUN=1 bash examples/qwen_image_edit/train_edit_20b.sh             # layout, memory per GPU, step time
#   NNODES=2 NODE_RANK=i MASTER_ADDR=node0 REWARD_SERVER_TOKEN=<same on every node> \
#       EDIT_DATA=/data/edits.jsonl bash examples/qwen_image_edit/train_edit_20b.sh
# EDIT_DATA: image + instruction JSONL records (images beside it); unset: the shipped tiny records.
# DRY_RUN=1 starts nothing; LAUNCH_ECHO=1 prints the commands. Knobs: examples/qwen_image/launch_lib.bash.
# Exit status: the entry point's (0 ok, 2 config, 3 dry run does not fit, 4 log-prob gap), 5 when a signal stopped
# the run after a checkpoint (start again with --resume auto).
set -euo pipefail

NNODES="${NNODES:-1}"
case "$NNODES" in
    1) SIZE=1node; DEFAULT_REWARD_GPUS=6,7; DEFAULT_REWARD_DEVICE=cuda ;;
    2) SIZE=2nodes; DEFAULT_REWARD_GPUS=""; DEFAULT_REWARD_DEVICE=cpu ;;
    *) if [[ -z "${RECIPE:-}" ]]; then
           echo "train_edit_20b: no layout for $NNODES nodes (1 or 2; or write a recipe and set RECIPE)" >&2; exit 2
       fi
       SIZE="${NNODES}nodes"; DEFAULT_REWARD_GPUS=""; DEFAULT_REWARD_DEVICE=cpu ;;
esac
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"  # node 0's address (set it on multi-node runs)
MASTER_PORT="${MASTER_PORT:-29500}"
REWARD_GPUS="${REWARD_GPUS-$DEFAULT_REWARD_GPUS}"  # GPUs of each node kept for the reward (not trainer ranks)
REWARD_KIND="${REWARD_KIND:-server}"
REWARD_SCORER="${REWARD_SCORER:-edit_text}"
REWARD_DEVICE_KIND="${REWARD_DEVICE_KIND:-$DEFAULT_REWARD_DEVICE}"
REWARD_PORT="${REWARD_PORT:-8000}"
PIPELINE_DIR="${PIPELINE_DIR:-/models/Qwen-Image-Edit-2511}"  # the diffusers QwenImageEditPlusPipeline folder
EDIT_DATA="${EDIT_DATA:-}"
GPU_KIND="${GPU_KIND:-H200}"  # H200 | H800: the dry run's figures, and NNODES=2 on H800 takes the H800 recipe
if [[ "$GPU_KIND" == "H800" && ( "$SIZE" == "2nodes" || "$SIZE" == "1node" ) ]]; then SIZE="${SIZE}_h800"; fi
RUN_DIR="${RUN_DIR:-runs/qwen-image-edit-20b-${SIZE}}"
RECIPE="${RECIPE:-examples.qwen_image_edit.recipe:edit_20b_${SIZE}}"
DRY_RUN="${DRY_RUN:-0}"
export EDIT_DATA

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
# shellcheck source=examples/qwen_image/launch_lib.bash
source examples/qwen_image/launch_lib.bash
launch "$@"
