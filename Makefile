# Two commands do everything on a fresh machine:
#   make demo   set up .venv and run the main job on recipes/demo.yaml
#   make test   set up .venv and run the linter and the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tether-installed

.PHONY: demo test lint unit bench docs clean

# torch first, pinned to the CPU build on local disk: a bare `torch` requirement would pull a
# multi-GB CUDA build. pyproject's range (>=2.4,<3) is satisfied by it, so nothing else moves it.
TORCH_SPEC ?= torch==2.13.0

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e '.[train,data,math,ray,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tether train recipes/demo.yaml

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(PY) -m pytest -q

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

bench: $(STAMP)
	$(PY) benchmarks/loop_overhead.py

docs: $(STAMP)
	$(VENV)/bin/tether config reference > docs/reference.md

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
