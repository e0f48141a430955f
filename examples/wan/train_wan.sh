#!/usr/bin/env bash
# Wan text-to-video, FlowGRPO x video OCR + temporal consistency, on NNODES nodes x 8 GPUs:
#   SIZE=14b (Wan2.1-T2V-14B, 81 x 480 x 832, default NNODES=2) | SIZE=5b (Wan2.2-TI2V-5B, 121 x 704 x 1280, NNODES=1;
#   image-to-video from I2V_RECORDS=records.jsonl ({"image", "instruction"} per line), else text-to-video; CFG 5.0)
#   | SIZE=a14b (Wan2.2-T2V-A14B's two experts, the low-noise one trained, 81 x 480 x 832, NNODES=2).
# The Ulysses degree (context parallelism over the video tokens) is the planner's: the smallest that fits the
# clip at this world size (examples/wan/recipe.py, planner/video.py). Plain torchrun form: run it on every node
# with its NODE_RANK, as examples/qwen_image/train_20b.sh.
#   SIZE=14b DRY_RUN=1 bash examples/wan/train_wan.sh     # layout, memory per GPU, step time; no GPU needed
#   SIZE=5b NNODES=1 bash examples/wan/train_wan.sh [--set steps=100 ...]
# The reward server (video_ocr+0.5*temporal_consistency) runs on node 0's CPUs; the knobs are launch_lib.bash's.
# Exit status: the entry point's (0 ok, 2 config, 3 dry run does not fit, 4 log-prob gap, 5 stopped by a signal
# after a checkpoint: start again with --resume auto).
set -euo pipefail

SIZE="${SIZE:-14b}"
case "$SIZE" in
    14b) DEFAULT_NNODES=2; DEFAULT_PIPELINE=/models/Wan2.1-T2V-14B-Diffusers ;;
    5b) DEFAULT_NNODES=1; DEFAULT_PIPELINE=/models/Wan2.2-TI2V-5B-Diffusers ;;
    a14b) DEFAULT_NNODES=2; DEFAULT_PIPELINE=/models/Wan2.2-T2V-A14B-Diffusers ;;
    *) echo "train_wan: SIZE=$SIZE: expected 14b, 5b or a14b" >&2; exit 2 ;;
esac
NNODES="${NNODES:-$DEFAULT_NNODES}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"  # node 0's address (set it on multi-node runs)
MASTER_PORT="${MASTER_PORT:-29500}"
REWARD_GPUS="${REWARD_GPUS-}"  # none carved out: the video scorers run on node 0's CPUs
REWARD_KIND="${REWARD_KIND:-server}"
REWARD_SCORER="${REWARD_SCORER:-video_ocr+0.5*temporal_consistency}"
REWARD_DEVICE_KIND="${REWARD_DEVICE_KIND:-cpu}"
REWARD_PORT="${REWARD_PORT:-8000}"
PIPELINE_DIR="${PIPELINE_DIR:-$DEFAULT_PIPELINE}"  # the diffusers WanPipeline folder
OCR_PROMPTS="${OCR_PROMPTS:-}"  # prompts file, one per line, each quoting its text ("" = the built-in list)
RUN_DIR="${RUN_DIR:-runs/wan-${SIZE}-video-ocr-${NNODES}nodes}"
RECIPE="${RECIPE:-examples.wan.recipe:wan_${SIZE}}"
GPU_KIND="${GPU_KIND:-H200}"  # for the dry run's figures and the planner's CP choice: H200 | H800
DRY_RUN="${DRY_RUN:-0}"
export OCR_PROMPTS GPU_KIND
# The recipe asks the planner for the Ulysses degree at the job's world size (torchrun sets WORLD_SIZE on the
# ranks; the dry run sets it too).

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
# shellcheck source=examples/qwen_image/launch_lib.bash
source examples/qwen_image/launch_lib.bash
launch "$@"
