# hbp: `make run` and `make test` do all the set-up on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PIP_Q   := --quiet --disable-pip-version-check
export WANDB_SILENT := true

.PHONY: install run test test-fast lint bench sweep report clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install $(PIP_Q) -e '.[dev,jax,launchers,bench]' 'torch==2.13.0' 2>&1 | grep -v "is ignored: it is neither" || true
	$(BIN)/python -c "import torch, hydra, hbp" 
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/python run.py workload=gpt2 mode=tiny

# One pytest worker per core (each test runs torch on one thread, tests/conftest.py): the suite
# stays within CI's time on 2 cores. TEST_JOBS=0 runs it in this process.
TEST_JOBS ?= 2

test: $(STAMP)
	WANDB_MODE=disabled $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist worksteal

test-fast: $(STAMP)
	WANDB_MODE=disabled $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist worksteal -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Every table of docs/results.md: a loop over conf/experiment/* (python run.py
# experiment=<name>) plus the scripts that are not bench runs (optimum, chunked CE, JAX); see experiments/bench.py.
bench: $(STAMP)
	$(BIN)/python experiments/bench.py $(BENCH_ARGS)

# A small resumable sweep (conf/sweep/quick.yaml) into outputs/sweeps/quick, then its report.
# Run it again: every finished run is skipped (SWEEP_ARGS=redo=true reruns them).
sweep: $(STAMP)
	$(BIN)/python run.py -m sweep=quick $(SWEEP_ARGS)
	$(BIN)/python -m hbp.report outputs/sweeps/quick

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache .hypothesis build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
