# Two commands on a fresh machine: `make run` (demo) and `make test` (the suite).
# Each creates .venv if missing and installs what it needs into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test test-slow lint demo-model clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e '.[test]'
	touch $@

run: $(VENV)/.base
	$(PY) -m jaxinfer generate --max_tokens=64

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest

test-slow: lint
	$(PY) -m pytest -m slow

demo-model: $(VENV)/.base
	$(PY) tools/train_demo.py --out=checkpoints --main_steps=1500 --draft_steps=2000

clean:
	rm -rf $(VENV) .pytest_cache
