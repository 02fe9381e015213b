# Two commands set up a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install train test test-fast lint clean

install: $(STAMP)

# Reinstall when the dependencies change.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# ARGS passes extra flags, e.g. make train ARGS='--set train.epochs=1'
train: install
	$(PY) -m app.train --config configs/mnist.toml $(ARGS)

test: install
	$(PY) -m pytest $(ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow" $(ARGS)

lint: install
	$(PY) -m ruff check app launch tests

clean:
	rm -rf $(VENV) runs .pytest_cache
