# megatron-omni GPU image: CUDA 13.0 + cuDNN devel, PyPI's torch 2.13.0 (CUDA 13.0), vLLM / vLLM-Omni,
# megatron-core, and TransformerEngine + apex compiled against that torch.
# Build:  docker build -t megatron-omni:0.1.0 .
# Check:  docker run --gpus all --rm megatron-omni:0.1.0   (runs tools/env_check.py)
# Multi-GPU check: docker run --gpus all --rm megatron-omni:0.1.0 torchrun --nproc-per-node 8 tools/env_check.py
#
# Why not the NGC PyTorch image: vllm==0.30.0 requires torch==2.13.0, torchvision==0.28.0 and
# torchaudio==2.11.0, so pip would replace NGC's own torch build under the TransformerEngine and apex compiled
# against it. Here the torch is the one vLLM requires, pinned by docker/constraints.txt (PIP_CONSTRAINT), and
# TE and apex are built against it (nvcc and cuDNN headers come from the devel base; CUDA 13.0 like torch).
FROM nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_CONSTRAINT=/opt/megatron-omni/constraints.txt \
    TORCH_CUDA_ARCH_LIST="9.0"

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev git ninja-build \
 && rm -rf /var/lib/apt/lists/* \
 && python3.12 -m venv /opt/venv \
 && pip install "pip==25.3" "setuptools==80.9.0" "wheel==0.45.1" "packaging==25.0" "pybind11==3.0.1"

# The torch the image is built around (CUDA 13.0), first and pinned.
COPY docker/constraints.txt /opt/megatron-omni/constraints.txt
RUN pip install "torch==2.13.0" "torchvision==0.28.0" "torchaudio==2.11.0" \
 && python -c "import torch; assert torch.version.cuda.startswith('13.0'), torch.version.cuda"

WORKDIR /workspace/megatron-omni
COPY pyproject.toml README.md ./
COPY megatron_omni ./megatron_omni
COPY model_providers ./model_providers
COPY tools ./tools
COPY examples ./examples
COPY docker ./docker

# The project with its pinned dependencies and the `gpu` extra (ModelOpt, vLLM, vLLM-Omni); PIP_CONSTRAINT
# refuses anything that would move torch.
RUN pip install -e ".[gpu]"

# The OCR reward on a GPU: onnxruntime-gpu and the CPU onnxruntime (a core dependency) install the same
# `onnxruntime` module, so the CPU one is removed and the GPU wheel reinstalled alone (its dependencies came
# with the extra above). The reward server refuses `--devices cuda:i` for OCR without this provider.
RUN pip uninstall -y onnxruntime onnxruntime-gpu \
 && pip install --no-deps "onnxruntime-gpu==1.31.1" \
 && python -c "import onnxruntime as o; p = o.get_available_providers(); assert 'CUDAExecutionProvider' in p, p"

# TransformerEngine's PyTorch extension and NVIDIA apex (the PyPI package named "apex" is unrelated), compiled
# against the installed torch (no build isolation: an isolated build would fetch another torch).
RUN NVTE_FRAMEWORK=pytorch MAX_JOBS=8 pip install --no-build-isolation "transformer-engine[pytorch]==2.9.0"
ARG APEX_COMMIT=25.09
RUN git clone --depth 1 --branch ${APEX_COMMIT} https://github.com/NVIDIA/apex /tmp/apex \
 && cd /tmp/apex \
 && APEX_CPP_EXT=1 APEX_CUDA_EXT=1 MAX_JOBS=8 pip install -v --no-build-isolation --no-deps . \
 && rm -rf /tmp/apex \
 && python -c "import torch, transformer_engine.pytorch, apex, vllm, vllm_omni; assert torch.__version__.startswith('2.13.0'), torch.__version__"

HEALTHCHECK CMD python tools/env_check.py || exit 1
CMD ["python", "tools/env_check.py"]
