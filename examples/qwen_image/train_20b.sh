#!/usr/bin/env bash
# Qwen-Image 20B, FlowGRPO x OCR reward on NNODES nodes x 8 GPUs (the layout is the recipe of that size):
#   NNODES=1: 6 trainer ranks at tp=6, the reward on GPUs 6,7 | NNODES=2: 16 ranks | NNODES=4: 32 ranks at tp=8 x dp=4.
# Plain torchrun form: run it on every node with its NODE_RANK (or submit slurm_20b.sbatch).
#   NNODES=1 bash examples/qwen_image/train_20b.sh [--set steps=100 ...]
#   NNODES=4 NODE_RANK=i MASTER_ADDR=node0 REWARD_SERVER_TOKEN=<same on every node> \
#       bash examples/qwen_image/train_20b.sh   # i = 0..3, one per node
# train_20b_1node.sh / _2nodes.sh / _4nodes.sh are this script with NNODES set.
# DRY_RUN=1 starts nothing: it validates the layout for this world size and prints the plan; LAUNCH_ECHO=1
# prints the commands (and the reward token each would see, as a fingerprint) instead of starting them.
# Exit status: the entry point's (0 ok, 2 config, 3 dry run does not fit, 4 log-prob gap), and 5 when a SIGTERM
# or SIGINT stopped the run after it wrote a checkpoint: start it again with --resume auto.
# ROLLOUT_GPUS=n: the last n ranks roll out on their own GPUs while the others train (disaggregated, staleness
# MAX_STALENESS=1; docs/async.md); with DRY_RUN=1 it prints that plan next to the colocated one.
# Knobs are described in launch_lib.bash, the layouts in docs/parallelism.md.
set -euo pipefail

NNODES="${NNODES:-1}"
case "$NNODES" in
    1) SIZE=1node; DEFAULT_REWARD_GPUS=6,7 ;;  # GPUs of each node kept for the reward (not trainer ranks)
    2|4) SIZE="${NNODES}nodes"; DEFAULT_REWARD_GPUS="" ;;  # none carved out: the OCR server runs on node 0's CPUs
    *) if [[ -z "${RECIPE:-}" ]]; then
           echo "train_20b: no layout for $NNODES nodes (1, 2 or 4; or write a recipe and set RECIPE)" >&2; exit 2
       fi
       SIZE="${NNODES}nodes"; DEFAULT_REWARD_GPUS="" ;;
esac
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"  # node 0's address (set it on multi-node runs)
MASTER_PORT="${MASTER_PORT:-29500}"
REWARD_GPUS="${REWARD_GPUS-$DEFAULT_REWARD_GPUS}"
REWARD_KIND="${REWARD_KIND:-server}"  # server | vlm (vllm serve JUDGE_MODEL) | url (REWARD_URL) | none
REWARD_SCORER="${REWARD_SCORER:-ocr}"  # what the reward server runs (REWARD_KIND=server)
REWARD_PORT="${REWARD_PORT:-8000}"
PIPELINE_DIR="${PIPELINE_DIR:-/models/Qwen-Image}"  # the diffusers Qwen-Image folder
OCR_PROMPTS="${OCR_PROMPTS:-}"  # prompts file, one per line ("" = the recipe's built-in list)
RUN_DIR="${RUN_DIR:-runs/qwen-image-20b-ocr-${SIZE}}"
CFG="${CFG:-0}"  # 1 = the CFG variant (true CFG 4.0)
CFG_SUFFIX=""
if [[ "$CFG" == 1 ]]; then CFG_SUFFIX="_cfg"; fi
RECIPE="${RECIPE:-examples.qwen_image.recipe:ocr_20b${CFG_SUFFIX}_${SIZE}}"
GPU_KIND="${GPU_KIND:-H200}"  # for the dry run's figures: H200 | H800
DRY_RUN="${DRY_RUN:-0}"
export OCR_PROMPTS

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
# shellcheck source=examples/qwen_image/launch_lib.bash
source examples/qwen_image/launch_lib.bash
launch "$@"
