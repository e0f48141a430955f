#!/usr/bin/env bash
# One prepared GPU check for one H200 (under 9 minutes, nothing downloaded there):
#   bash tools/gpu_check.sh                    # on the GPU machine, in the repository root
#   bash tools/gpu_check.sh --download-wheels  # here, once: fills .whl/ with what that machine lacks
#
# The lent machine has torch 2.11+cu130, transformers, safetensors, einops, psutil, tqdm, scipy, rich, pytest but
# no megatron-core, diffusers or ModelOpt; --download-wheels fetches their cp312 wheels (+ importlib-metadata, and
# what ModelOpt imports that the machine lacks: pulp, pydantic, torchprofile) into the ignored folder .whl/ (about
# 29 MB), which travels with the tree (the device tool: carry [".whl"]).
# TransformerEngine (about 280 MB) and vLLM do not fit: on that machine (d) and the vLLM-Omni engine tests
# skip with their reason; in the GPU image (Dockerfile) they run.
#
# It runs tests/gpu (each test records its figures) and prints one table:
#   (a) our local model vs diffusers on CUDA in bf16 (max abs diff, each vs diffusers fp32),
#   (b) one FlowGRPO step of the small preset in bf16 on one GPU (seconds per phase),
#   (c) forward+backward of one 20B-shaped MMDiT block (1024 image + 256 text tokens, batch 1, 2, 4):
#       TFLOP/s and MFU against 790 TFLOP/s,
#   (d) the te spec's parity with local in bf16 when TransformerEngine imports,
#   (e) the FP8 rollout forward (`rollout.quantization=fp8`: ModelOpt's FP8 weights, per-token FP8 inputs, row-wise
#       scaled FP8 GEMMs) against bf16 on 20B-shaped blocks, batch 1, 4, 8: ms per block and speed-up,
#   (f) with vLLM-Omni (the GPU image): its FP8 engine against its bf16 one, images/s and the FP8 probe,
# and writes $OUT_DIR/gpu_check.json, which `python -m megatron_omni.train --dry-run --mfu-from FILE` reads
# (launch scripts: MFU_FROM=FILE) instead of the assumed MFU 0.35.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl}"
OUT_DIR="${OUT_DIR:-${OUT:-gpu_check}}"
GPU_WHEELS=(megatron-core==0.16.1 diffusers==0.40.0 importlib-metadata==8.7.0 nvidia-modelopt==0.39.0 pulp==3.3.2
            pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 torchprofile==0.1.0)

if [[ "${1:-}" == --download-wheels ]]; then
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$WHEELS" "${GPU_WHEELS[@]}"
    exit 0
fi

start=$SECONDS
mkdir -p "$OUT_DIR"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
        "$WHEELS"/*.whl
    export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:${PYTHONPATH}}"
fi
export PYTHONPATH="$(pwd)${PYTHONPATH:+:${PYTHONPATH}}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export GPU_CHECK_RECORD="$OUT_DIR/figures.jsonl"
rm -f "$GPU_CHECK_RECORD"
"$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print("gpu:", torch.cuda.get_device_name(0), "torch", torch.__version__)'
rc=0
# pyproject's addopts apply; -p no:cacheprovider: the tree may be read-only there.
timeout 480 "$PYTHON" -m pytest tests/gpu -m gpu -q -rs -p no:cacheprovider -o addopts="" \
    --junitxml "$OUT_DIR/tests.xml" 2>&1 | tee "$OUT_DIR/pytest.log" || rc=$?
"$PYTHON" tools/gpu_check_report.py "$GPU_CHECK_RECORD" "$OUT_DIR/gpu_check.json"
echo "gpu check: $(( SECONDS - start )) s, tests rc=$rc"
exit "$rc"
