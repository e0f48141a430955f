#!/usr/bin/env bash
# Qwen-Image 20B on 2 node(s): train_20b.sh with NNODES=2 (its header describes the knobs).
NNODES="${NNODES:-2}" exec bash "$(dirname "${BASH_SOURCE[0]}")/train_20b.sh" "$@"
