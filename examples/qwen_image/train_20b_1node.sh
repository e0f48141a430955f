#!/usr/bin/env bash
# Qwen-Image 20B on 1 node(s): train_20b.sh with NNODES=1 (its header describes the knobs).
NNODES="${NNODES:-1}" exec bash "$(dirname "${BASH_SOURCE[0]}")/train_20b.sh" "$@"
