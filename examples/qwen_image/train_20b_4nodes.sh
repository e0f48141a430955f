#!/usr/bin/env bash
# Qwen-Image 20B on 4 node(s): train_20b.sh with NNODES=4 (its header describes the knobs).
NNODES="${NNODES:-4}" exec bash "$(dirname "${BASH_SOURCE[0]}")/train_20b.sh" "$@"
