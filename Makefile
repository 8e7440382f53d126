# Two commands do all set-up on a fresh machine:
#   make run    install, then run the main job (gristmill batch: examples/prompts.jsonl -> results.jsonl)
#   make test   install, then run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install run test bench clean

$(BIN)/gristmill: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build on disk, not GBs of CUDA packages.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(BIN)/gristmill

install: $(BIN)/gristmill

run: install
	$(BIN)/gristmill batch examples/prompts.jsonl -o results.jsonl --max-tokens 64

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) results.jsonl
