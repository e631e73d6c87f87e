# Two commands on a fresh machine: `make run` (demo) and `make test` (the suite).
# Each creates .venv if missing and installs what it needs into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# libtpu's ahead-of-time compiler lives in its own venv, so the CPU suite never probes
# for a TPU (see tests/tpu_aot/conftest.py and jaxinfer/aot.py).
TPU_VENV := .venv-tpu
TPU_PY := $(TPU_VENV)/bin/python
TPU_AOT := $(TPU_PY) -m pytest tests/tpu_aot --confcutdir=tests/tpu_aot -p no:cacheprovider

.PHONY: run test test-slow test-tpu-aot test-tpu-aot-slow lint demo-model clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e '.[test]'
	touch $@

$(TPU_VENV)/.base: pyproject.toml
	test -x $(TPU_PY) || $(PYTHON) -m venv $(TPU_VENV)
	$(TPU_PY) -m pip install -q --upgrade pip
	$(TPU_PY) -m pip install -q -e '.[tpu-aot]'
	touch $@

run: $(VENV)/.base
	$(PY) -m jaxinfer generate --max_tokens=64

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest
	$(MAKE) test-tpu-aot

test-slow: lint
	$(PY) -m pytest -m slow
	$(MAKE) test-tpu-aot-slow

test-tpu-aot: $(TPU_VENV)/.base
	$(TPU_AOT)

test-tpu-aot-slow: $(TPU_VENV)/.base
	$(TPU_AOT) -m slow

demo-model: $(VENV)/.base
	$(PY) tools/train_demo.py --out=checkpoints --size=large --batch=32 \
	    --main_steps=3000 --draft_steps=3000 --lr=2e-3

clean:
	rm -rf $(VENV) $(TPU_VENV) .pytest_cache
