#!/usr/bin/env bash
# BAGEL-7B-MoT text-to-image FlowGRPO on one node (8 GPUs) through the one entry point (python -m megatron_omni.train
# --recipe examples.bagel.recipe:bagel_7b_<gpu>), launched by examples/qwen_image/launch_lib.bash like the other
# families' scripts. The recipe's tp is the smallest the MoT planner (planner/mot.py: both experts' weights, the
# generation expert's grads and Adam state (the understanding expert frozen), activations of a window step with
# text CFG, the in-process rollout's bf16 copy) fits on the GPU kind: tp 1 on H200, tp 4 on H800.
#   DRY_RUN=1 bash examples/bagel/train_bagel.sh                  # H200 and H800: layouts, memory per GPU, step FLOPs
#   DRY_RUN=1 GPU_KIND=H800 bash examples/bagel/train_bagel.sh    # one kind; no GPU needed either way
#   DRY_RUN=1 GPU_KIND=H800 bash examples/bagel/train_bagel.sh --set parallel.tp=2 --set parallel.ulysses=2
#       # context parallelism 2: the generation tokens' activations / 2 and the per-layer k/v all-gather printed
#   GPU_KIND=H200 PIPELINE_DIR=/models/BAGEL-7B-MoT bash examples/bagel/train_bagel.sh   # the run (one kind)
# Knobs: GPU_KIND ("H200 H800" for a dry run, one kind for a run), PIPELINE_DIR (the published BAGEL folder:
# ema.safetensors, ae.safetensors, the configs and Qwen2's tokenizer files; its prompts are text through that
# tokenizer), GPUS_PER_NODE (8), REWARD_KIND / REWARD_* (launch_lib.bash; default: our reward server with the OCR
# scorer on this node's CPUs), RUN_DIR, and extra arguments (--set ..., --resume auto) for the entry point.
# Exit status: the entry point's (0 ok, 2 config/layout, 3 the dry run does not fit on some kind).
# The tiny CPU run: python -m megatron_omni.train --recipe examples.bagel.recipe:tiny
set -euo pipefail

GPU_KIND="${GPU_KIND:-H200 H800}"
NNODES=1
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NODE_RANK=0
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
REWARD_GPUS="${REWARD_GPUS-}"
REWARD_KIND="${REWARD_KIND:-server}"
REWARD_SCORER="${REWARD_SCORER:-ocr}"
REWARD_DEVICE_KIND="${REWARD_DEVICE_KIND:-cpu}"
PIPELINE_DIR="${PIPELINE_DIR:-/models/BAGEL-7B-MoT}"
DRY_RUN="${DRY_RUN:-0}"
PYTHON="${PYTHON:-python}"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
source examples/qwen_image/launch_lib.bash

recipe_for() {  # GPU kind -> the recipe planned for it
    case "$1" in
        H200|H800) echo "examples.bagel.recipe:bagel_7b_${1,,}" ;;
        *) echo "train_bagel: GPU_KIND=$1: expected H200 or H800" >&2; exit 2 ;;
    esac
}

kinds=($GPU_KIND)
if [[ "$DRY_RUN" == 1 ]]; then
    status=0 run_dir="${RUN_DIR:-}"
    for kind in "${kinds[@]}"; do
        RECIPE="$(recipe_for "$kind")"
        RUN_DIR="${run_dir:-runs/bagel-7b-mot-${kind,,}}"
        ( GPU_KIND="$kind" launch "$@" ) || status=$?
    done
    exit "$status"
fi
(( ${#kinds[@]} == 1 )) || { echo "train_bagel: a run takes one GPU_KIND, not '$GPU_KIND'" >&2; exit 2; }
RECIPE="$(recipe_for "${kinds[0]}")"
RUN_DIR="${RUN_DIR:-runs/bagel-7b-mot-${kinds[0],,}}"
launch "$@"
