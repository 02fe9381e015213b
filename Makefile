# Two commands set up a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: install train test test-fast test-under-load coverage bench local-cluster slurm-packages slurm-cluster \
        slurm-cluster-stop lint docs compat clean

install: $(STAMP)

# Reinstall when the dependencies change. Not the bench extra (matplotlib): Keras 3
# imports matplotlib.pyplot whenever it is installed, which costs every process that
# imports TensorFlow about 0.6 s (docs/testing.md); `make bench` installs it.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

# ARGS passes extra flags, e.g. make train ARGS='--set train.epochs=1'
train: install
	$(PY) -m app.train --config configs/mnist.toml $(ARGS)

# Tests with an in-process cluster run in pytest processes of their own: the
# chief's connection to the cluster changes the process for good. The other tests
# run on PARALLEL runners (pytest-xdist) on the 2 cores: the end-to-end ones spend
# half their time waiting on the processes they start. The cluster tests compute
# more than they wait: two runners, an in-process cluster each. A file stays on one
# runner, its tests in order, its fixtures built once, but for the files that
# tests/conftest.py spreads; the longest start first (conftest.LONGEST_FIRST).
PARALLEL ?= 3
XDIST    := --dist loadfile --no-loadscope-reorder
test: install
	$(PY) -m pytest -m "not cluster" -n $(PARALLEL) $(XDIST) $(ARGS)
	$(PY) -m pytest -m cluster -n 2 $(XDIST) $(ARGS)

# The suite with one busy process per core beside it, as on a loaded CI machine:
# run it before submitting a change that touches timing (docs/testing.md).
test-under-load: install
	@busy=""; for i in $$(seq $$(nproc)); do sh -c 'while :; do :; done' & busy="$$busy $$!"; done; \
	trap 'kill $$busy' EXIT; $(MAKE) test ARGS='$(ARGS)'

# Line coverage of app/ and launch/, the processes the tests start included
# ([tool.coverage] in pyproject.toml).
coverage: install
	$(PY) -m pytest -m "not cluster" -n $(PARALLEL) $(XDIST) --cov --cov-report= $(ARGS)
	$(PY) -m pytest -m cluster -n 2 $(XDIST) --cov --cov-append --cov-report=term $(ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow and not cluster" -n $(PARALLEL) $(XDIST) $(ARGS)

# Every strategy side by side: table, runs/bench/bench.json and bench.png
bench: $(BENCH_STAMP)
	$(PY) -m tools.bench --config configs/mnist.toml --steps 300 $(ARGS)

# A parameter-server cluster in one process, e.g. make local-cluster WORKERS=2 PS=2
WORKERS ?= 2
PS      ?= 1
local-cluster: install
	$(PY) -m launch.inprocess --workers $(WORKERS) --ps $(PS) --config configs/mnist_ps.toml $(ARGS)

# A one-node SLURM cluster on this machine (root; installs Debian's packages if
# missing): then `sbatch launch/slurm/train.sbatch`. State and logs in SLURM_DIR.
SLURM_DIR ?= /tmp/tf-slurm
slurm-packages:
	$(PYTHON) -m launch.slurm.local_cluster install

slurm-cluster: install
	$(PY) -m launch.slurm.local_cluster start --dir $(SLURM_DIR) $(ARGS)

slurm-cluster-stop:
	$(PYTHON) -m launch.slurm.local_cluster stop --dir $(SLURM_DIR)

lint: install
	$(PY) -m ruff check app launch tools tests examples experiments

# docs/configuration.md from the config dataclasses (tests/test_configdoc.py checks it)
docs: install
	$(PY) -m tools.configdoc

# The compatibility suite, recording each zoo case's outcome under each way of training
# (docs/results/compatibility.json), then docs/compatibility.md; `make test` checks both.
compat: install
	COMPAT_RECORD=1 $(PY) -m pytest tests/test_compat.py tests/test_compat_multi_worker.py \
	    -m "not cluster" -k "not matrix" $(ARGS)
	COMPAT_RECORD=1 $(PY) -m pytest tests/test_compat.py -m cluster $(ARGS)
	$(PY) -m tools.compatdoc

clean:
	rm -rf $(VENV) runs .pytest_cache
