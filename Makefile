# hbp: `make run` and `make test` do all the set-up on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PIP_Q   := --quiet --disable-pip-version-check
export WANDB_SILENT := true

.PHONY: install run test test-fast lint bench sweep notebooks clean gpu-check gpu-wheels

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

# The CUDA paths in one run (experiments/gpu_check.py; docs/results.md "CUDA"): gpu_check.json
# and gpu_check.md under GPU_CHECK_OUT; exit status 1 when a check fails, 2 without a GPU, 3 when
# a package is missing. GPU_CHECK_ARGS=--cpu runs the same checks on the CPU with tiny shapes.
# On a machine whose python already has torch with CUDA and that reaches no registry (a lent
# GPU machine), name that python and a folder of wheels for what it lacks (`make gpu-wheels`,
# run where a registry is reachable, puts highspy, omegaconf and antlr4 for CPython 3.12 there):
#   make gpu-check GPU_PYTHON=python3 WHEELS=.whl
# Only those wheels are installed (into GPU_SITE, put first on PYTHONPATH; the repo itself is
# on it too): the pins are not, so the run uses that machine's torch and transformers, and the
# JSON names their versions.
GPU_CHECK_OUT ?= outputs/gpu_check
GPU_SITE ?= /tmp/hbp-gpu-site
WHEELS ?= .whl
GPU_WHEEL_TAGS := --only-binary=:all: --python-version 3.12 --implementation cp \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64

gpu-wheels:
	mkdir -p $(WHEELS)
	$(PY) -m pip download $(PIP_Q) --no-deps $(GPU_WHEEL_TAGS) -d $(WHEELS) highspy==1.15.1 omegaconf==2.3.0
	$(PY) -m pip wheel $(PIP_Q) --no-deps -w $(WHEELS) antlr4-python3-runtime==4.9.3
ifdef GPU_PYTHON
gpu-check:
	@if ls $(WHEELS)/*.whl >/dev/null 2>&1; then \
	  $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	    --target $(GPU_SITE) $(WHEELS)/*.whl \
	  || { echo "gpu-check: the wheels in $(WHEELS) did not install (see pip's message above)"; exit 3; }; \
	fi
	PYTHONPATH=$(GPU_SITE):$(CURDIR) $(GPU_PYTHON) experiments/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)
else
gpu-check: $(STAMP)
	$(BIN)/python experiments/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)
endif

# The four notebooks, headless (jupyter execute; nothing is saved into the .ipynb files). Each
# reads ONE sweep directory, HBP_SWEEP (default: a small sweep it makes in the temp dir), and
# writes its figures to HBP_FIGURES (default: the temp dir):
#   make sweep && make notebooks HBP_SWEEP=outputs/sweeps/quick HBP_FIGURES=outputs/figures
notebooks: $(STAMP)
	for nb in pareto memory_timeline frontier analysis; do \
	  MPLBACKEND=Agg WANDB_MODE=disabled \
	  $(if $(HBP_SWEEP),HBP_SWEEP=$(abspath $(HBP_SWEEP))) \
	  $(if $(HBP_FIGURES),HBP_FIGURES=$(abspath $(HBP_FIGURES))) \
	  $(BIN)/jupyter execute --timeout=600 notebooks/$$nb.ipynb || exit 1; \
	done

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache .hypothesis build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
