# Two commands set up a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install train test test-fast bench local-cluster slurm-packages slurm-cluster \
        slurm-cluster-stop lint docs compat clean

install: $(STAMP)

# Reinstall when the dependencies change.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

# ARGS passes extra flags, e.g. make train ARGS='--set train.epochs=1'
train: install
	$(PY) -m app.train --config configs/mnist.toml $(ARGS)

# Tests with an in-process cluster run in a pytest process of their own: the
# chief's connection to the cluster changes the process for good.
test: install
	$(PY) -m pytest -m "not cluster" $(ARGS)
	$(PY) -m pytest -m cluster $(ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow and not cluster" $(ARGS)

# Every strategy side by side: table, runs/bench/bench.json and bench.png
bench: install
	$(PY) -m app.bench --config configs/mnist.toml --steps 300 $(ARGS)

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
	$(PY) -m ruff check app launch tests examples

# docs/configuration.md from the config dataclasses (tests/test_configdoc.py checks it)
docs: install
	$(PY) -m app.configdoc

# The compatibility suite, recording each zoo case's outcome under each way of training
# (docs/compatibility.json), then docs/compatibility.md; `make test` checks both.
compat: install
	COMPAT_RECORD=1 $(PY) -m pytest tests/test_compat.py -m "not cluster" -k "not matrix" $(ARGS)
	COMPAT_RECORD=1 $(PY) -m pytest tests/test_compat.py -m cluster $(ARGS)
	$(PY) -m app.compatdoc

clean:
	rm -rf $(VENV) runs .pytest_cache
