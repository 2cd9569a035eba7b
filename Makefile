# hbp: `make run` and `make test` do all the set-up on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PIP_Q   := --quiet --disable-pip-version-check
export WANDB_SILENT := true

.PHONY: install run test test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install $(PIP_Q) -e '.[dev,jax,launchers]' 2>&1 | grep -v "is ignored: it is neither" || true
	$(BIN)/python -c "import torch, hydra, hbp" 
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/python run.py workload=gpt2 mode=tiny

test: $(STAMP)
	WANDB_MODE=disabled $(BIN)/python -m pytest -q

test-fast: $(STAMP)
	WANDB_MODE=disabled $(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python experiments/bench.py $(BENCH_ARGS)

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache .hypothesis build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
