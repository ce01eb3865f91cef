# The contributor's commands; each runs in the project's virtual environment (README: install).
PYTHON ?= python

.PHONY: test lint format slow cuda docs

test:  ## the README's test command after the lint: what CI runs
	ruff check . && ruff format --check . && $(PYTHON) -m pytest -q

lint:  ## ruff's checks and format, fixing what it can
	ruff check --fix . && ruff format .

slow:  ## the benchmarks and long runs left out of the default tests
	$(PYTHON) -m pytest -q -m slow

cuda:  ## every backend and method on a CUDA GPU
	$(PYTHON) -m pytest -q -m cuda

docs:  ## regenerate every generated page: docs/cli.md, docs/methods.md, results/README.md, docs/results.md's tables
	$(PYTHON) -m gtx.cli.reference .
