# The README's two commands are `make quickstart` and `make test`; each creates or refreshes
# the virtual environment in .venv (pinned by constraints.txt) before it runs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.lapheads-installed
PYTEST_ARGS ?=

.PHONY: setup system-deps quickstart lint docs test test-fast test-latest bench coverage-tables clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.14.1 torchvision==0.29.1
	$(PIP) install -q -c constraints.txt -e ".[all,test]"
	touch $(STAMP)

# Headless Chromium renders the HTML report in one test; installed when missing (Debian).
system-deps:
	@command -v chromium >/dev/null 2>&1 || (command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	  echo "note: chromium not installed; the HTML rendering test will be skipped")

quickstart: setup
	$(VENV)/bin/lapheads quickstart --out runs/quickstart

# Parallel workers (pytest-xdist, one per core, one torch thread each: tests/conftest.py); tests
# that share module-scoped runs are kept on one worker (xdist_group); the 15 slowest are listed.
# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set: the suite starts ~50 Python
# processes, and without .pyc files each one compiles lapheads again and pytest re-rewrites the
# asserts of every test module and of hypothesis (__pycache__/ is git-ignored).
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -p no:cacheprovider -n auto --dist loadgroup --durations=15

# Lint, formatting and types (ruff, mypy; configured in pyproject.toml): seconds, so they run first.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# The docs site, strictly: a broken link, a missing reference or a docstring that does not render
# fails the build (into build/site; without --quiet, which would hide a broken link's failure).
# `make test` builds it too, as one test of tests/test_docs.py, so it shares the workers.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

test: setup system-deps lint
	$(PYTEST) $(PYTEST_ARGS)

test-fast: setup
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

# The integration tests (timm, transformers, peft, accelerate, lm-eval, datasets, MLflow, W&B,
# submitit, pydantic) against the newest release of each, in a second environment refreshed on
# every run (no constraints; torch and torchvision as pinned); tests/run_latest.py lists the
# libraries and their test files, and prints which version broke what.
VENV_LATEST ?= .venv-latest
test-latest:
	test -x $(VENV_LATEST)/bin/python || $(PYTHON) -m venv $(VENV_LATEST)
	$(VENV_LATEST)/bin/python -m pip install -q --upgrade pip
	$(VENV_LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[all,test]" \
	  $$($(PYTHON) tests/run_latest.py --packages)
	PYTHONDONTWRITEBYTECODE= $(VENV_LATEST)/bin/python tests/run_latest.py $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/run_all.py

# The measured coverage tables of docs/ (tools/coverage/, a repository tool outside the package);
# tests/test_*_coverage.py fail when the committed files are stale.
coverage-tables: setup
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m tools.coverage timm --write docs/coverage-timm.md
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m tools.coverage transformers --write docs/coverage-transformers.md

clean:
	rm -rf $(VENV) $(VENV_LATEST) build dist src/*.egg-info .pytest_cache .ruff_cache .mypy_cache
