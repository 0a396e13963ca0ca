# `make train`: set up (first time) and run the built-in default training run.
# `make test`:  set up (first time) and run the test suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is pinned: an unpinned torch pulls a multi-GB CUDA build. This is the CPU build.
TORCH  ?= torch==2.13.0

.PHONY: setup train test lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

train: setup
	$(VENV)/bin/dapo train $(ARGS)

test: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
