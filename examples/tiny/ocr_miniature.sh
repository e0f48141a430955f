#!/usr/bin/env bash
# The OCR miniature: FlowGRPO on the shipped tiny text-rendering pipeline (examples/tiny/text_pipeline) with
# the OCR reward served by the reward server in its own process, one CPU rank (TP=1). Prints the held-out
# OCR similarity before and after and writes eval_before_after.png into RUN_DIR.
#   bash examples/tiny/ocr_miniature.sh                                    # TP=1
#   NPROC_PER_NODE=2 bash examples/tiny/ocr_miniature.sh --set parallel.tp=2   # TP=2 (2 gloo ranks)
set -euo pipefail
export RECIPE="${RECIPE:-examples.tiny.recipe:ocr_miniature}"
export REWARD_SERVER="${REWARD_SERVER:-1}" REWARD_SCORER="${REWARD_SCORER:-ocr}"
export NPROC_PER_NODE="${NPROC_PER_NODE:-1}" RUN_DIR="${RUN_DIR:-runs/tiny-ocr-miniature}"
exec bash "$(dirname "${BASH_SOURCE[0]}")/train_tiny.sh" "$@"
