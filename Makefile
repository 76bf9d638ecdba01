# distill: `make help` lists the targets.
PYTHON ?= python3
# CPU machines: a local CPU build of torch, installed before the package so that pip does
# not pull a multi-GB CUDA build. A machine that already has torch (a GPU box) keeps it.
TORCH_CPU ?= torch==2.13.0
EXPERIMENT ?= onpolicy_demo
BENCH_OUT ?= bench_out

.PHONY: help install demo test test-oldest test-fast test-quick mutate lint format bench clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

install:  ## install torch (CPU build if none) and the package with its dev, loggers, lora extras
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q $(TORCH_CPU)
	$(PYTHON) -m pip install -q -e ".[dev,loggers,lora]"

# one thread per process: the demo's models are tiny, and a second thread only adds
# synchronization (and contention on a shared machine)
DEMO_THREADS ?= 1

demo: install  ## distil the bundled demo teacher into a fresh student on CPU (docs/notes/demo.md)
	OMP_NUM_THREADS=$(DEMO_THREADS) $(PYTHON) -m distill.train +experiment=$(EXPERIMENT)

test: install  ## run the test suite (GPU tests skip without CUDA), then the loop tests on the oldest Lightning
	$(PYTHON) -m pytest -q
	$(MAKE) test-oldest

# The oldest Lightning supported (pyproject's floor): the tests that lean on its loop
# (step windows, resume, signals, strategies) run against it too, from a side folder.
# 2.4 resumes a step-end checkpoint one micro-batch off (Lightning #18060) and 2.5 extends
# a finished run by one step fewer: docs/design.md.
LIGHTNING_OLDEST ?= 2.6.0
OLDEST_DIR ?= .lightning-$(LIGHTNING_OLDEST)
OLDEST_TESTS ?= tests/callbacks tests/test_resume.py tests/test_normalization.py \
	tests/test_strategies.py tests/test_train.py tests/test_logs.py

test-oldest:  ## the loop tests against the oldest supported Lightning ($(LIGHTNING_OLDEST))
	@test -d $(OLDEST_DIR)/lightning || $(PYTHON) -m pip install -q --no-deps --target $(OLDEST_DIR) lightning==$(LIGHTNING_OLDEST)
	PYTHONPATH=$(OLDEST_DIR) $(PYTHON) -c "import lightning; assert lightning.__version__ == '$(LIGHTNING_OLDEST)', lightning.__version__"
	PYTHONPATH=$(OLDEST_DIR) $(PYTHON) -m pytest -q $(OLDEST_TESTS)

test-fast:  ## the tests, without reinstalling
	$(PYTHON) -m pytest -q -x

test-quick:  ## the tests without those marked slow (each > 10 s on 2 cores); make test runs all
	$(PYTHON) -m pytest -q -x -m "not slow"

mutate:  ## plant known one-line bugs in a copy, one at a time; every one must be caught (docs/testing.md)
	OMP_NUM_THREADS=1 $(PYTHON) scripts/mutate.py

lint:  ## ruff
	$(PYTHON) -m ruff check distill tests scripts bench

format:  ## ruff format
	$(PYTHON) -m ruff format distill tests scripts bench

bench:  ## GPU: loss benchmark -> $(BENCH_OUT)/ (table, JSON, plot) for docs/benchmarks.md
	$(PYTHON) bench/bench_loss.py --out $(BENCH_OUT)

clean:  ## remove run outputs and caches
	rm -rf outputs multirun lightning_logs .pytest_cache .ruff_cache .lightning-*
