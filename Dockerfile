# megatron-omni GPU image: NGC PyTorch + TransformerEngine + apex + megatron-core + vLLM / vLLM-Omni.
# Build:  docker build -t megatron-omni:0.1.0 .
# Check:  docker run --gpus all --rm megatron-omni:0.1.0   (runs tools/env_check.py)
# Multi-GPU check: docker run --gpus all --rm megatron-omni:0.1.0 torchrun --nproc-per-node 8 tools/env_check.py
FROM nvcr.io/nvidia/pytorch:25.10-py3

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1

# NVIDIA apex with its fused CUDA kernels (the PyPI package named "apex" is unrelated and must not be used).
ARG APEX_COMMIT=25.09
RUN git clone --depth 1 --branch ${APEX_COMMIT} https://github.com/NVIDIA/apex /tmp/apex \
 && cd /tmp/apex \
 && APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install -v --no-build-isolation . \
 && rm -rf /tmp/apex

WORKDIR /workspace/megatron-omni
COPY pyproject.toml README.md ./
COPY megatron_omni ./megatron_omni
COPY model_providers ./model_providers
COPY tools ./tools
COPY examples ./examples

# The base image's torch stays: install the project without letting pip replace it, then the GPU extra
# (TransformerEngine, ModelOpt, vLLM, vLLM-Omni) and the remaining pinned runtime dependencies.
RUN pip install --no-deps -e . \
 && pip install "megatron-core==0.16.1" "psutil==7.2.2" "einops==0.8.2" "diffusers==0.40.0" \
        "transformers==5.14.1" "safetensors==0.8.0" "rapidocr==3.10.0" "onnxruntime==1.32.0" \
        "rapidfuzz==3.14.6" "tqdm==4.70.1" "matplotlib==3.11.2" "tensorboard==2.21.0" "wandb==0.31.0" \
        "aiohttp==3.14.5" \
 && pip install "transformer-engine[pytorch]==2.9.0" "nvidia-modelopt==0.39.0" "vllm==0.30.0" "vllm-omni==0.30.0"

HEALTHCHECK CMD python tools/env_check.py || exit 1
CMD ["python", "tools/env_check.py"]
